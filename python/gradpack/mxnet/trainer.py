"""``gradpack.mxnet.Trainer``: ``mx.gluon.Trainer`` with ``compress_params=``,
using gradpack's stores (see ``gradpack.mxnet.module`` for the one-context rule)."""
import mxnet as mx

from .module import resolve_compression, store_for

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
        # the store name stays in the config and each run gets a fresh store.
        config = self._kvstore_params
        requested = config["kvstore"]
        config["kvstore"] = store_for(requested, len(self._contexts), self._compression_params, "Trainer")
        try:
            super(Trainer, self)._init_kvstore()
        finally:
            config["kvstore"] = requested
