"""``gradpack.mxnet.Trainer``: ``mx.gluon.Trainer`` with ``compress_params=``,
using gradpack's stores (see ``gradpack.mxnet.module`` for which store a name
gives, and the one-context rule)."""
import mxnet as mx

from .kvstore import GradpackStore, runs_on_servers
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
