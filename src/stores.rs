//! Opening a store by its type name: the one place the fronts (the C ABI,
//! the C++ bridge, and Python through the C ABI) create stores. Every name
//! is looked up in `kvstore::STORE_TYPES`; what comes back is a `Store`,
//! and every later call goes through that trait.

use crate::dist::{Config, DistWorker};
use crate::error::Result;
use crate::kvstore::{self, AllreduceStore, KVStore, Kind, Store, StoreType};

/// A new store of `type_name`: a local or device store, a member of the MPI
/// job this process was started in, or a worker of a parameter-server job
/// that the DMLC_* variables describe (this blocks until every node
/// registered). The two distributed stores sit side by side: each holds
/// its transport (`allreduce::World`, `dist::Postoffice`) below it.
pub fn open(type_name: &str) -> Result<Box<dyn Store>> {
    Ok(match kvstore::store_type(type_name) {
        Some((_, Kind::Dist { .. })) => Box::new(DistWorker::start(type_name, Config::from_env()?)?),
        Some((_, Kind::Local(StoreType::Allreduce))) => Box::new(AllreduceStore::join()?),
        _ => Box::new(KVStore::new(type_name)?), // an unknown name: KVStore::new says which exist
    })
}
