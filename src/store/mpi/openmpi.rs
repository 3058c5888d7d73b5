//! Open MPI, found and loaded when the first all-reduce store opens, so that
//! no build (a wheel included) needs MPI's headers, libclang or libmpi, and a
//! job runs on the Open MPI its `mpirun` belongs to.
//!
//! Which library, first found:
//! 1. `$GRADPACK_MPI_LIBRARY` (a path), when set;
//! 2. `libmpi.so.40` in `lib/` or `lib64/` beside the `bin/` of the `mpirun`
//!    the shell would run (links resolved): the first executable regular
//!    file named `mpirun` in `PATH`'s entries, an empty entry meaning the
//!    current directory (a non-executable `mpirun` is passed over, as the
//!    shell passes it over): an Open MPI installed under its own prefix;
//! 3. `libmpi.so.40` from the loader's search path (Debian's
//!    `/usr/lib/<arch>/libmpi.so.40`, whose `mpirun` is `/usr/bin/orterun`).
//!
//! It is loaded with `RTLD_GLOBAL`, as Open MPI's own components need (they
//! are plugins that resolve libmpi's symbols through the global scope), and
//! never unloaded. Only Open MPI's ABI is spoken (libmpi.so.40, versions 3 to
//! 5): a handle is the address of one of its predefined objects
//! (`ompi_mpi_comm_world`, ...). A library that is not Open MPI, or lacks one
//! symbol, is refused naming it, before any call; every later error of
//! starting MPI names the library loaded too (`Mpi::library`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use crate::error::{Error, Result};

/// `MPI_Comm`, `MPI_Datatype` and `MPI_Op` in Open MPI: pointers to its objects.
pub type Handle = *mut c_void;
/// `MPI_User_function`.
pub type UserFunction = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut Handle);

const SONAME: &str = "libmpi.so.40";
/// Open MPI's `MPI_THREAD_MULTIPLE`, `MPI_SUCCESS`, `MPI_IN_PLACE` and
/// `MPI_MAX_LIBRARY_VERSION_STRING` (mpi.h; the same in 3.x, 4.x and 5.x).
pub const THREAD_MULTIPLE: c_int = 3;
const SUCCESS: c_int = 0;
pub const IN_PLACE: *mut c_void = std::ptr::without_provenance_mut(1);
const MAX_LIBRARY_VERSION_STRING: usize = 256;

/// The functions and predefined handles the all-reduce store uses.
pub struct Mpi {
    pub library: String,
    pub version: String,
    pub init_thread: unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, *mut c_int) -> c_int,
    pub initialized: unsafe extern "C" fn(*mut c_int) -> c_int,
    pub finalized: unsafe extern "C" fn(*mut c_int) -> c_int,
    pub finalize: unsafe extern "C" fn() -> c_int,
    pub comm_dup: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    pub comm_rank: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    pub comm_size: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    pub bcast: unsafe extern "C" fn(*mut c_void, c_int, Handle, c_int, Handle) -> c_int,
    pub allreduce: unsafe extern "C" fn(*const c_void, *mut c_void, c_int, Handle, Handle, Handle) -> c_int,
    pub op_create: unsafe extern "C" fn(UserFunction, c_int, *mut Handle) -> c_int,
    pub comm_world: Handle,
    pub float: Handle,
    pub uint64: Handle,
    pub sum: Handle,
    pub max: Handle,
}

// SAFETY: the handles are addresses of Open MPI's predefined objects, which
// live as long as the library (never unloaded); thread safety of the calls is
// MPI's (MPI_THREAD_MULTIPLE, checked at initialisation).
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

/// Maps an MPI return code to an error naming the call.
pub fn check(call: &str, rc: c_int) -> Result<()> {
    if rc == SUCCESS {
        Ok(())
    } else {
        Err(Error::Store(format!("{call} failed with MPI error code {rc}")))
    }
}

fn candidates() -> Vec<PathBuf> {
    let cwd = std::env::current_dir().unwrap_or_default();
    candidates_from(std::env::var_os("GRADPACK_MPI_LIBRARY").as_deref(), std::env::var_os("PATH").as_deref(), &cwd)
}

extern "C" {
    fn access(path: *const c_char, mode: c_int) -> c_int;
}

/// `access`'s `X_OK`.
const X_OK: c_int = 1;

/// Whether the shell would run `path` as a command: a regular file (links
/// followed) that this process may execute.
fn executable(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    path.is_file() && unsafe { access(c.as_ptr(), X_OK) } == 0
}

/// The libraries to try, in the module doc's order, for these values of
/// `GRADPACK_MPI_LIBRARY` and `PATH`. The `mpirun` is the one the shell
/// would run: the first executable regular file named `mpirun` in PATH's
/// entries, an empty entry (or a relative one) taken from `cwd`, as the
/// shell takes it from the current directory.
fn candidates_from(explicit: Option<&std::ffi::OsStr>, path: Option<&std::ffi::OsStr>, cwd: &Path) -> Vec<PathBuf> {
    if let Some(library) = explicit {
        return vec![PathBuf::from(library)];
    }
    let mut found = Vec::new();
    if let Some(path) = path {
        if let Some(mpirun) = std::env::split_paths(path).map(|d| cwd.join(d).join("mpirun")).find(|p| executable(p)) {
            if let Some(prefix) = mpirun.canonicalize().ok().as_deref().and_then(Path::parent).and_then(Path::parent) {
                found.extend(["lib", "lib64"].map(|d| prefix.join(d).join(SONAME)).into_iter().filter(|p| p.is_file()));
            }
        }
    }
    found.push(PathBuf::from(SONAME)); // the loader's search path
    found
}

/// The value of symbol `name`, as `T`.
///
/// # Safety
/// `T` is the symbol's true type: a function pointer of its C signature, or
/// a pointer for the address of a data object.
unsafe fn symbol<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: the caller's.
    unsafe { lib.get::<T>(name.as_bytes_with_nul()) }.ok().map(|s| *s)
}

impl Mpi {
    /// Finds, loads and checks Open MPI (see the module doc).
    pub fn load() -> Result<Mpi> {
        let mut tried = Vec::new();
        for path in candidates() {
            // SAFETY: loading Open MPI runs its library constructors, which
            // only set up its own state; it is never unloaded, so no symbol
            // taken from it outlives it.
            match unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) } {
                Ok(lib) => return Mpi::bind(lib, &path),
                // libloading's own text is only "dlopen failed": dlerror's is the source.
                Err(e) => tried.push(match std::error::Error::source(&e) {
                    Some(why) => why.to_string(),
                    None => format!("{}: {e}", path.display()),
                }),
            }
        }
        Err(Error::Store(format!(
            "'dist_sync_allreduce' found no Open MPI to load (tried {}). Install Open MPI (Debian: apt-get install \
             openmpi-bin), put its mpirun on PATH, or set GRADPACK_MPI_LIBRARY to its libmpi.so.40",
            tried.join("; ")
        )))
    }

    fn bind(lib: Library, path: &Path) -> Result<Mpi> {
        let library = path.display().to_string();
        let lib: &'static Library = Box::leak(Box::new(lib)); // never unloaded (module doc)
        let missing = |name: &str| {
            Error::Store(format!(
                "{library} is not an Open MPI library gradpack can use: it has no symbol {name} (gradpack's all-reduce \
                 store speaks Open MPI's ABI, libmpi.so.40); set GRADPACK_MPI_LIBRARY to Open MPI's libmpi.so.40"
            ))
        };
        // SAFETY (each `f!`): the symbol is Open MPI's function of that name,
        // whose C signature (mpi.h) is the type it is stored as.
        macro_rules! f {
            ($name:literal) => {
                unsafe { symbol(lib, $name) }.ok_or_else(|| missing($name))?
            };
        }
        // SAFETY (each `h!`): the address of the predefined object, which is
        // what Open MPI's mpi.h hands out as the handle; it is never read here.
        macro_rules! h {
            ($name:literal) => {
                unsafe { symbol::<*mut c_void>(lib, $name) }.filter(|p| !p.is_null()).ok_or_else(|| missing($name))?
            };
        }
        let get_library_version: unsafe extern "C" fn(*mut c_char, *mut c_int) -> c_int = f!("MPI_Get_library_version");
        let mut text = [0 as c_char; MAX_LIBRARY_VERSION_STRING + 1];
        let mut len: c_int = 0;
        // SAFETY: the buffer holds MPI_MAX_LIBRARY_VERSION_STRING characters
        // (plus one spare NUL), as the call needs; callable before MPI_Init.
        check("MPI_Get_library_version", unsafe { get_library_version(text.as_mut_ptr(), &mut len) })?;
        // SAFETY: the last element is never written (it stays NUL).
        let version = unsafe { CStr::from_ptr(text.as_ptr()) }.to_string_lossy().trim().to_string();
        if !version.starts_with("Open MPI") {
            return Err(Error::Store(format!(
                "{library} is {version:?}, not Open MPI: gradpack's all-reduce store speaks Open MPI's ABI \
                 (libmpi.so.40); set GRADPACK_MPI_LIBRARY to Open MPI's libmpi.so.40"
            )));
        }
        Ok(Mpi {
            init_thread: f!("MPI_Init_thread"),
            initialized: f!("MPI_Initialized"),
            finalized: f!("MPI_Finalized"),
            finalize: f!("MPI_Finalize"),
            comm_dup: f!("MPI_Comm_dup"),
            comm_rank: f!("MPI_Comm_rank"),
            comm_size: f!("MPI_Comm_size"),
            bcast: f!("MPI_Bcast"),
            allreduce: f!("MPI_Allreduce"),
            op_create: f!("MPI_Op_create"),
            comm_world: h!("ompi_mpi_comm_world"),
            float: h!("ompi_mpi_float"),
            uint64: h!("ompi_mpi_uint64_t"),
            sum: h!("ompi_mpi_op_sum"),
            max: h!("ompi_mpi_op_max"),
            library,
            version,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A fresh directory under the system's temporary one.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gradpack-openmpi-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `prefix/bin/mpirun` with `mode`, beside `prefix/lib/libmpi.so.40`
    /// (a text file: it is never loaded here, only chosen or not).
    fn install(prefix: &Path, mode: u32) -> PathBuf {
        for d in ["bin", "lib"] {
            std::fs::create_dir_all(prefix.join(d)).unwrap();
        }
        let mpirun = prefix.join("bin/mpirun");
        std::fs::write(&mpirun, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&mpirun, std::fs::Permissions::from_mode(mode)).unwrap();
        std::fs::write(prefix.join("lib").join(SONAME), "not a library").unwrap();
        prefix.join("lib").join(SONAME).canonicalize().unwrap()
    }

    #[test]
    fn the_mpirun_is_the_one_the_shell_would_run() {
        let dir = scratch("path");
        let decoy = install(&dir.join("decoy"), 0o644);
        let real = install(&dir.join("real"), 0o755);
        let path = std::env::join_paths([dir.join("decoy/bin"), dir.join("real/bin")]).unwrap();
        let got = candidates_from(None, Some(&path), Path::new("/"));
        assert_eq!(got, vec![real.clone(), PathBuf::from(SONAME)], "the non-executable {decoy:?} is passed over");
        // A directory named mpirun is no command either.
        std::fs::create_dir_all(dir.join("dirs/bin/mpirun")).unwrap();
        let path = std::env::join_paths([dir.join("dirs/bin"), dir.join("real/bin")]).unwrap();
        assert_eq!(candidates_from(None, Some(&path), Path::new("/")), vec![real.clone(), PathBuf::from(SONAME)]);
        // GRADPACK_MPI_LIBRARY wins over PATH.
        assert_eq!(candidates_from(Some("/x/libmpi.so.40".as_ref()), Some(&path), Path::new("/")), vec![PathBuf::from("/x/libmpi.so.40")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_empty_path_entry_is_the_current_directory_and_counts_only_when_executable() {
        let dir = scratch("cwd");
        let here = install(&dir.join("here"), 0o644);
        let real = install(&dir.join("real"), 0o755);
        let cwd = dir.join("here/bin");
        // ":real/bin": the empty entry first, as a PATH of "::/usr/bin" has it.
        let path = std::ffi::OsString::from(format!(":{}", dir.join("real/bin").display()));
        assert_eq!(candidates_from(None, Some(&path), &cwd), vec![real.clone(), PathBuf::from(SONAME)], "{here:?} is not executable");
        std::fs::set_permissions(cwd.join("mpirun"), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(candidates_from(None, Some(&path), &cwd), vec![here, PathBuf::from(SONAME)]);
        // No mpirun anywhere: only the loader's search path.
        assert_eq!(candidates_from(None, Some(dir.as_os_str()), &cwd), vec![PathBuf::from(SONAME)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
