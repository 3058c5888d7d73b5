"""``gradpack.mxnet.Trainer``: ``mx.gluon.Trainer`` with ``compress_params=``,
using gradpack's stores (see ``gradpack.mxnet.module`` for which store a name
gives, and the one-context rule)."""
import os
import pickle
import tempfile

import mxnet as mx

from .kvstore import GradpackStore, _gradpack_payload, _gradpack_payload_of, runs_on_servers
from .module import native, native_create, resolve_compression, store_for

__all__ = ["Trainer"]


class Trainer(mx.gluon.Trainer):
    """``mx.gluon.Trainer`` with ``compress_params`` (or ``compression_params``)."""

    def __init__(self, params, optimizer, optimizer_params=None, kvstore="device",
                 compression_params=None, update_on_kvstore=None, compress_params=None):
        compression = resolve_compression(compress_params, compression_params)
        super(Trainer, self).__init__(params, optimizer, optimizer_params=optimizer_params,
                                      kvstore=kvstore, compression_params=compression,
                                      update_on_kvstore=update_on_kvstore)

    def _init_kvstore(self):
        # MXNet re-runs this after _reset_kvstore (e.g. on load_parameters), so
        # the config keeps what the user asked for and each run starts from it.
        config = self._kvstore_params
        requested, update_on_kvstore = config["kvstore"], config["update_on_kvstore"]
        if native(requested, self._compression_params):
            with native_create():
                return super(Trainer, self)._init_kvstore()
        store = store_for(requested, len(self._contexts), self._compression_params, "Trainer")
        if isinstance(store, GradpackStore) and (self._contains_sparse_weight or self._contains_sparse_grad):
            return self._init_sparse_kvstore(store, update_on_kvstore)
        if isinstance(store, GradpackStore):
            if (update_on_kvstore is None and store._dist and "async" not in store.type
                    and not runs_on_servers(self._optimizer)):
                # The servers cannot run this optimizer: MXNet's own path with
                # update_on_kvstore=False (the store sums, the workers update).
                config["update_on_kvstore"] = False
        config["kvstore"] = store
        try:
            super(Trainer, self)._init_kvstore()
        finally:
            config["kvstore"], config["update_on_kvstore"] = requested, update_on_kvstore

    def _init_sparse_kvstore(self, store, update_on_kvstore):
        """MXNet's rules for sparse parameters, with gradpack's store (MXNet's
        own code accepts only its KVStore class there). A sparse weight is
        updated on the store; sparse gradients with dense weights update on
        the store when it is distributed, unless told otherwise where MXNet
        allows it. The store holds sparse keys as its "data" section says."""
        distributed = store._dist
        if self._contains_sparse_weight:
            if update_on_kvstore is False:
                raise ValueError("Cannot set update_on_kvstore=False when sparse weights are present.")
            update_on_kvstore = True
        else:
            if update_on_kvstore is False and distributed:
                raise ValueError("Cannot set update_on_kvstore=False on dist kvstore when sparse gradients "
                                 "are present.")
            update_on_kvstore = distributed if update_on_kvstore is None else update_on_kvstore
        if distributed and "async" in store.type and not update_on_kvstore:
            raise ValueError("Please set update_on_kvstore=True when training in async mode.")
        if update_on_kvstore and distributed and "async" in store.type and not runs_on_servers(self._optimizer):
            raise ValueError("%s cannot run on gradpack's servers (SGD, NAG, Adam) and '%s' updates only there"
                             % (type(self._optimizer).__name__, store.type))
        if self._compression_params:
            store.set_gradient_compression(self._compression_params)
        if update_on_kvstore:
            store.set_optimizer(self._optimizer)
        self._distributed = distributed
        self._kvstore, self._update_on_kvstore = store, update_on_kvstore
        self._kv_initialized = True

    def save_states(self, fname):
        """MXNet's ``save_states``; when the workers update
        (update_on_kvstore=False) on a gradpack store, the store's compression
        states go in the same file, so a resumed run continues exactly."""
        self._ready()
        store = self._kvstore
        if self._update_on_kvstore or not isinstance(store, GradpackStore):
            return super(Trainer, self).save_states(fname)
        payload = _gradpack_payload_of(self._updaters[0].get_states(dump_optimizer=True), store._store)
        with open(fname, "wb") as f:
            pickle.dump(payload, f)

    def _ready(self):
        """The store and parameters initialized, as MXNet's save/load do first."""
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()

    def load_states(self, fname):
        self._ready()
        with open(fname, "rb") as f:
            payload = _gradpack_payload(f.read())
        if payload is None or self._update_on_kvstore or not isinstance(self._kvstore, GradpackStore):
            return super(Trainer, self).load_states(fname)
        self._kvstore._store.set_compression_states(payload["gradpack_compression"])  # checked whole first
        # MXNet's own load of its updater states, from a file of just those.
        fd, path = tempfile.mkstemp(suffix=".states")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload["mxnet_states"])
            super(Trainer, self).load_states(path)
        finally:
            os.remove(path)
