"""``gradpack.mxnet.Trainer``: ``mx.gluon.Trainer`` with ``compress_params=``,
using gradpack's stores (see ``gradpack.mxnet.module`` for which store a name
gives, and the one-context rule)."""
import os
import pickle
import tempfile

import mxnet as mx

from .kvstore import GradpackStore, _gradpack_payload, runs_on_servers
from .module import check_dense, native, native_create, store_for

__all__ = ["Trainer"]


class Trainer(mx.gluon.Trainer):
    """``mx.gluon.Trainer`` with ``compress_params`` (or ``compression_params``)."""

    def __init__(self, params, optimizer, optimizer_params=None, kvstore="device",
                 compression_params=None, update_on_kvstore=None, compress_params=None):
        from .module import resolve_compression
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
        if isinstance(store, GradpackStore):
            self._check_dense(store)
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

    def _check_dense(self, store):
        check_dense("Trainer", store, [(p.name, p._stype, p._grad_stype) for p in self._params],
                    self._compression_params)

    def save_states(self, fname):
        """MXNet's ``save_states``; when the workers update
        (update_on_kvstore=False) on a gradpack store, the store's compression
        states go in the same file, so a resumed run continues exactly."""
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        store = self._kvstore
        if self._update_on_kvstore or not isinstance(store, GradpackStore):
            return super(Trainer, self).save_states(fname)
        payload = {"mxnet_states": self._updaters[0].get_states(dump_optimizer=True),
                   "gradpack_compression": store._store.compression_states()}
        with open(fname, "wb") as f:
            pickle.dump(payload, f)

    def load_states(self, fname):
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
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
