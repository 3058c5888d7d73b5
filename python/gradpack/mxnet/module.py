"""``gradpack.mxnet.Module``: ``mx.mod.Module`` with ``compress_params=``.

With compression, a kvstore given by name is gradpack's store of that type.
Without it, a local store name gets exactly MXNet's behaviour (MXNet's own
store, created by MXNet), while a dist name gets gradpack's store, because the
job's servers are gradpack's. As in MXNet, one context with a non-dist store
type needs no store at all; but asking for compression there raises an error
instead of silently dropping it.
"""
import contextlib

import mxnet as mx

from ..base import Error
from .kvstore import create

__all__ = ["Module"]


def resolve_compression(compress_params, compression_params):
    """One dict from gradpack's and MXNet's spellings, validated now."""
    if compress_params is not None and compression_params is not None:
        raise Error("give compress_params or MXNet's compression_params, not both")
    params = compress_params if compress_params is not None else compression_params
    if params is None:
        return None
    from .. import kv
    kv.create("device").set_compress(params)  # raises gradpack.Error naming the bad key
    return dict(params)


def compresses(params):
    if params is None:
        return False
    kind = params.get("compress", params.get("type", "none"))
    return str(kind).strip().lower() != "none"


def native(kvstore, compress_params):
    """True when MXNet itself should create the store named `kvstore`: a
    local name without compression."""
    return isinstance(kvstore, str) and "dist" not in kvstore and not compresses(compress_params)


@contextlib.contextmanager
def native_create():
    """MXNet's own ``mx.kv.create`` while MXNet creates a store by name (after
    ``install()`` the name would otherwise come back as gradpack's)."""
    from . import _saved
    if not _saved:
        yield
        return
    patched = mx.kvstore.create
    mx.kvstore.create = _saved[(mx.kvstore, "create")]
    try:
        yield
    finally:
        mx.kvstore.create = patched


def store_for(kvstore, num_contexts, compress_params, owner):
    """What to hand MXNet's ``_create_kvstore`` when `native` is false: a
    gradpack store for a store name, or the name itself where MXNet would
    create no store (one context, no dist, no compression)."""
    if not isinstance(kvstore, str):
        return kvstore
    if num_contexts == 1 and "dist" not in kvstore:
        if compresses(compress_params):
            raise Error(
                "%s: compress_params needs a KVStore, but with one context and store '%s' "
                "MXNet creates none, so nothing would be compressed. Use two or more contexts "
                "(e.g. [mx.cpu(0), mx.cpu(1)]) or a dist store." % (owner, kvstore))
        return kvstore
    return create(kvstore)


class Module(mx.mod.Module):
    """``mx.mod.Module`` with ``compress_params`` (or MXNet's ``compression_params``)."""

    def __init__(self, *args, compress_params=None, compression_params=None, **kwargs):
        params = resolve_compression(compress_params, compression_params)
        super(Module, self).__init__(*args, compression_params=params, **kwargs)

    def init_optimizer(self, kvstore="local", optimizer="sgd", optimizer_params=(("learning_rate", 0.01),),
                       force_init=False):
        if self.optimizer_initialized and not force_init:
            return super(Module, self).init_optimizer(kvstore, optimizer, optimizer_params, force_init)
        if native(kvstore, self._compression_params):
            with native_create():
                return super(Module, self).init_optimizer(kvstore, optimizer, optimizer_params, force_init)
        kvstore = store_for(kvstore, len(self._context), self._compression_params, "Module")
        return super(Module, self).init_optimizer(kvstore, optimizer, optimizer_params, force_init)
