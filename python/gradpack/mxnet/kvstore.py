"""gradpack's KVStores as MXNet KVStore plugins (``mx.kv.KVStoreBase``).

They take NDArrays without copying: a CPU NDArray's memory is handed to the
Rust store after waiting on MXNet's engine (pending writes for inputs, pending
reads and writes for outputs), so results are ordered as MXNet's own store
orders them. ``set_optimizer`` runs gradpack's Rust optimizer for MXNet's SGD,
NAG and Adam (the same float32 steps, with the optimizer's per-parameter
learning rate, weight decay and rescale_grad synchronised before every update)
and MXNet's own updater, run locally, for any other optimizer.
"""
import ctypes
import pickle

import mxnet as mx
import numpy as np

from .. import kv as _kv
from ..kv import _as_list
from ..base import Error, NativeHandle

__all__ = ["GradpackStore", "KVStoreError", "create"]


class KVStoreError(Error, mx.base.MXNetError):
    """A gradpack store error raised through MXNet's API: a gradpack.Error and
    an MXNetError, so that code catching either sees it."""


def _mxnet_errors(method):
    """Re-raises gradpack.Error from `method` as KVStoreError (an updater's
    own exceptions pass unchanged)."""
    import functools

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except KVStoreError:
            raise
        except Error as e:
            raise KVStoreError(str(e)) from e
    return wrapped

_STORE_TYPES = _kv.STORE_TYPES  # the Rust core's table


def _wait(arr, write):
    fn = mx.base._LIB.MXNDArrayWaitToWrite if write else mx.base._LIB.MXNDArrayWaitToRead
    mx.base.check_call(fn(arr.handle))


def _np_view(arr, key, what, write):
    """A numpy array over an NDArray's own memory (no copy)."""
    if not isinstance(arr, mx.nd.NDArray):
        raise Error("key %r: %s must be an NDArray, got %s" % (key, what, type(arr).__name__))
    if arr.stype != "default":
        raise Error("key %r: %s has storage type '%s'; gradpack's stores take dense arrays only "
                    "(sparse gradients and row_sparse_pull are not supported)" % (key, what, arr.stype))
    if arr.context.device_type != "cpu":
        raise Error("key %r: %s lives on %s; this gradpack build handles CPU arrays only"
                    % (key, what, arr.context))
    _wait(arr, write)
    ptr = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(arr.handle, ctypes.byref(ptr)))
    dtype = np.dtype(arr.dtype)
    nbytes = int(np.prod(arr.shape)) * dtype.itemsize
    if nbytes == 0:
        return np.zeros(arr.shape, dtype)
    buf = (ctypes.c_char * nbytes).from_address(ptr.value)
    return np.frombuffer(buf, dtype=dtype).reshape(arr.shape)


def _views(key, value, what, write):
    """Mirror MXNet's key/value pairing, replacing NDArrays by numpy views."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise Error("%d keys need a list of %d %s" % (len(key), len(key), what))
        return [[_np_view(a, k, what, write) for a in _as_list(v)] for k, v in zip(key, value)]
    return [_np_view(a, key, what, write) for a in _as_list(value)]


class _RustUpdater(object):
    """What Trainer.load_states reads back as ``kvstore._updater.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


_RUST_OPTIMIZERS = {mx.optimizer.SGD: "sgd", mx.optimizer.NAG: "nag", mx.optimizer.Adam: "adam"}


def _rust_name(optimizer):
    """gradpack's name for an optimizer it runs itself, or None (exact classes
    only: a subclass may change the update rule). multi_precision is passed
    on: it matters for float16 keys only (a float32 master copy), as in MXNet."""
    return _RUST_OPTIMIZERS.get(type(optimizer))


def runs_on_servers(optimizer):
    """Whether gradpack's servers run `optimizer` themselves (SGD, NAG, Adam)."""
    return _rust_name(optimizer) is not None


def _pairs(key, value):
    """(key, value) pairs from MXNet's single-key or list-of-keys calling forms."""
    if isinstance(key, (list, tuple)):
        return list(zip(key, value))
    return [(key, value)]


class GradpackStore(NativeHandle, mx.kv.KVStoreBase):
    """A gradpack 'local' or 'device' store with MXNet's KVStore interface.
    Not copyable or picklable (its gradpack store owns native state)."""

    _instead = ("create another with mx.kv.create() and carry its states over with "
                "save_optimizer_states()/load_optimizer_states() and "
                "save_compression_states()/load_compression_states()")

    def _describe(self):  # each registered store type is a subclass of its own
        return "gradpack.mxnet.GradpackStore ('%s')" % self._name

    def __init__(self, name="device"):
        if name not in _STORE_TYPES:
            raise Error("gradpack has no '%s' KVStore here (known: %s)" % (name, ", ".join(_STORE_TYPES)))
        self._name = name
        self._dist = name in _kv.DIST_TYPES
        self._store = _kv.create(name)  # a server or scheduler process serves here, then exits
        self._optimizer = None
        self._updater = None
        self._rust = False
        self._scaling = None
        # Dist stores whose optimizer the servers cannot run: the servers sum,
        # and each worker applies the update to its own copy of the weights.
        self._worker_updater = None
        self._weights = {}
        self._pending = set()
        self._shapes = {}
        # Keys of sparse values: in MXNet's own store (local types), or held
        # dense (dist types); see "data" below.
        self._native_store = None
        self._native_keys = set()
        self._dense_keys = set()

    # ------------------------------------------------------------ identity
    @property
    def type(self):
        return self._name

    @property
    def rank(self):
        return self._store.rank

    @property
    def num_workers(self):
        return self._store.num_workers

    def is_capable(self, capability):
        if capability.lower() == mx.kv.KVStoreBase.OPTIMIZER:
            return True
        raise Error("unknown capability '%s'" % capability)

    def barrier(self):
        self._store.barrier()

    def _barrier(self):
        self._store.barrier()

    def stats(self):
        return self._store.stats()

    # ------------------------------------------------------------ data
    # Sparse arrays: on a local store a key initialized with a sparse value
    # lives in MXNet's own store of the same type (MXNet's behaviour, exactly;
    # it is never compressed, as MXNet compresses dense arrays only). On a
    # dist store, whose servers are gradpack's, such a key is held dense:
    # pushes are densified and row_sparse_pull selects rows from the dense
    # value (the same values; the traffic is dense).
    def _routed(self, key, value=None):
        """True when a call must go key by key: a routed key, or a sparse array."""
        keys = key if isinstance(key, (list, tuple)) else [key]
        if any(k in self._native_keys or k in self._dense_keys for k in keys):
            return True
        arrays = [a for v in _as_list(value) for a in _as_list(v)] if value is not None else []
        return any(isinstance(a, mx.nd.NDArray) and a.stype != "default" for a in arrays)

    def _native(self):
        """MXNet's own store of this type, made on first use, with this
        store's optimizer or updater."""
        if self._native_store is None:
            from . import _saved
            create = _saved[(mx.kv, "create")] if _saved else mx.kv.create
            self._native_store = create(self._name)
            if self._optimizer is not None:
                self._native_store.set_optimizer(self._optimizer)
            elif self._updater is not None:
                self._native_store._set_updater(self._updater)
        return self._native_store

    def init(self, key, value):
        if not self._routed(key, value):
            return self._init_dense(key, value)
        for k, v in _pairs(key, value):
            sparse = any(a.stype != "default" for a in _as_list(v))
            if sparse and not self._dist:
                self._native().init(k, v)
                self._native_keys.add(k)
            elif sparse:
                self._init_dense(k, [a.tostype("default") for a in _as_list(v)])
                self._dense_keys.add(k)
            else:
                self._init_dense(k, v)

    def broadcast(self, key, value, out, priority=0):
        if not self._routed(key, value):
            return self._broadcast_dense(key, value, out)
        outs = dict(_pairs(key, out))
        for k, v in _pairs(key, value):
            self.init(k, v)
            self.pull(k, out=outs[k], ignore_sparse=False)

    def push(self, key, value, priority=0):
        if not self._routed(key, value):
            return self._push_dense(key, value)
        for k, v in _pairs(key, value):
            if k in self._native_keys:
                self._native().push(k, v, priority)
            else:
                self._push_dense(k, [a.tostype("default") if a.stype != "default" else a for a in _as_list(v)])

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        if out is None:
            raise Error("pull needs out=")
        if not self._routed(key, out):
            return self._pull_dense(key, out)
        for k, o in _pairs(key, out):
            if k in self._native_keys:
                self._native().pull(k, out=o, priority=priority, ignore_sparse=ignore_sparse)
                continue
            dense = [a for a in _as_list(o) if a.stype == "default"]
            sparse = [a for a in _as_list(o) if a.stype != "default"]
            if sparse and ignore_sparse:
                import warnings
                warnings.warn("key %r: sparse outputs of pull are ignored (ignore_sparse=True), as in MXNet" % (k,))
            elif sparse:
                # The value, as the sparse type each output has (Trainer pulls
                # sparse gradients this way), outside autograd as MXNet's pull.
                if k not in self._shapes:
                    raise Error("key %r: not initialized (call init first)" % (k,))
                shape, dtype = self._shapes[k]
                with mx.autograd.pause():
                    value = mx.nd.zeros(shape, dtype=dtype)
                    self._pull_dense(k, value)
                    for a in sparse:
                        value.tostype(a.stype).copyto(a)
            if dense:
                self._pull_dense(k, dense)

    def pushpull(self, key, value, out=None, priority=0):
        if not self._routed(key, value):
            return self._pushpull_dense(key, value, out)
        outs = dict(_pairs(key, value if out is None else out))
        for k, v in _pairs(key, value):
            if k in self._native_keys:
                self._native().pushpull(k, v, out=outs[k], priority=priority)
            else:
                self.push(k, v)
                self.pull(k, out=outs[k], ignore_sparse=False)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        if out is None or row_ids is None:
            raise Error("row_sparse_pull needs out= and row_ids=")
        keys = key if isinstance(key, (list, tuple)) else [key]
        outs = out if isinstance(key, (list, tuple)) else [out]
        ids = row_ids if isinstance(key, (list, tuple)) else [row_ids]
        for k, o, r in zip(keys, outs, ids):
            if k in self._native_keys:
                self._native().row_sparse_pull(k, out=o, priority=priority, row_ids=r)
            elif k in self._dense_keys:
                shape, dtype = self._shapes[k]
                targets = _as_list(o)
                rows_per = list(r) if isinstance(r, (list, tuple)) else [r] * len(targets)
                # Outside autograd, as MXNet's own row_sparse_pull (Trainer calls it
                # inside a record section).
                with mx.autograd.pause():
                    dense = mx.nd.zeros(shape, dtype=dtype)
                    self._pull_dense(k, dense)
                    for target, rows in zip(targets, rows_per):
                        # Row ids may repeat and come in any shape; a row_sparse
                        # array's indices are sorted and unique.
                        ids = np.unique(rows.asnumpy().astype(np.int64).ravel())
                        picked = mx.nd.sparse.retain(dense.tostype("row_sparse"), mx.nd.array(ids, dtype="int64"))
                        picked.copyto(target)
            elif k in self._shapes:
                raise Error("key %r: row_sparse_pull needs a key initialized with a row_sparse value" % (k,))
            else:
                raise Error("key %r: not initialized (call init first)" % (k,))

    # ------------------------------------------------------------ data
    def _refusing(self, key, value, init):
        """This front's own checks of a call: on an all-reduce store a
        refusal still takes part in the call's first key (gradpack.kv's
        _refusing), which every other worker starts with."""
        k = key[0] if isinstance(key, (list, tuple)) and key else key
        v = _as_list(value[0] if isinstance(key, (list, tuple)) and value else value)
        shape = tuple(v[0].shape) if init and v and hasattr(v[0], "shape") else None
        return self._store._refusing(k, init, shape)

    def _init_dense(self, key, value):
        with self._refusing(key, value, True):
            views = _views(key, value, "init value", False)
        self._store.init(key, views)
        for k, v in _pairs(key, views):
            first = _as_list(v)[0]
            self._shapes[k] = (first.shape, first.dtype)
            if self._worker_updater is not None:
                self._weights[k] = mx.nd.array(first, dtype=first.dtype)

    def _broadcast_dense(self, key, value, out):
        with self._refusing(key, value, True):
            values = _views(key, value, "broadcast value", False)
            outs = _views(key, out, "broadcast output", True)
        self._store.broadcast(key, values, out=outs)
        for k, v in _pairs(key, values):
            first = _as_list(v)[0]
            self._shapes[k] = (first.shape, first.dtype)
            if self._worker_updater is not None:
                self._weights[k] = mx.nd.array(first, dtype=first.dtype)

    def _push_dense(self, key, value):
        with self._refusing(key, value, False):
            values = _views(key, value, "pushed value", False)
        self._before_update(key)
        self._store.push(key, values)
        if self._worker_updater is not None:
            self._pending.update(k for k, _ in _pairs(key, values))

    def _pull_dense(self, key, out):
        outs = _views(key, out, "pull output", True)
        if self._worker_updater is not None:
            return self._pull_updated(key, outs)
        self._store.pull(key, out=outs)

    def _pushpull_dense(self, key, value, out=None):
        with self._refusing(key, value, False):
            values = _views(key, value, "pushed value", out is None)
            outs = values if out is None else _views(key, out, "pushpull output", True)
        self._before_update(key)
        if self._worker_updater is not None:
            self._store.push(key, values)
            self._pending.update(k for k, _ in _pairs(key, values))
            return self._pull_updated(key, outs)
        self._store.pushpull(key, values, out=outs)

    def _pull_updated(self, key, outs):
        """The worker-side update: once per push, the servers' sum of this
        round's gradients goes through MXNet's updater into this worker's
        weights (every worker applies the same sum, so all stay equal)."""
        for k, out in _pairs(key, outs):
            weight = self._weights.get(k)
            if weight is None:
                raise Error("key %r: not initialized (call init first)" % (k,))
            if k in self._pending:
                grad = np.empty(weight.shape, np.float32)
                self._store.pull(k, out=[grad])
                self._pending.discard(k)
                self._worker_updater(k, mx.nd.array(grad, dtype=weight.dtype), weight)
            values = weight.asnumpy()
            for o in _as_list(out):
                o[...] = values

    # ------------------------------------------------------------ configuration
    def set_compress(self, compress_params):
        self._store.set_compress(compress_params)

    def set_gradient_compression(self, compression_params):
        self._store.set_compress(compression_params)

    def set_optimizer(self, optimizer):
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise Error("set_optimizer takes an mx.optimizer.Optimizer, got %s" % type(optimizer).__name__)
        name = _rust_name(optimizer)
        if name is None and self._dist:
            if "async" in self._name:
                raise Error("%s cannot run on gradpack's servers, which run SGD, NAG and Adam, and a '%s' "
                            "store updates only on its servers (as in MXNet); use one of those optimizers "
                            "or a dist_sync store" % (type(optimizer).__name__, self._name))
            self._use_worker_updater(optimizer)
            return
        if name is not None:
            params = {"learning_rate": optimizer.lr, "multi_precision": bool(optimizer.multi_precision)}
            if self._dist:
                # Servers see no per-parameter rates: send what MXNet would apply.
                params.update(wd=optimizer.wd, rescale_grad=optimizer.rescale_grad,
                              clip_gradient=optimizer.clip_gradient)
            if name in ("sgd", "nag"):
                params["momentum"] = optimizer.momentum
            else:
                params.update(beta1=optimizer.beta1, beta2=optimizer.beta2, epsilon=optimizer.epsilon)
            self._store.set_optimizer(name, **params)
            self._updater = _RustUpdater(optimizer)
            self._rust = True
        else:
            updater = mx.optimizer.get_updater(optimizer)
            self._store.set_updater(lambda key, merged, stored: _run_mxnet_updater(updater, key, merged, stored,
                                                                                   self._dtype(key)))
            self._updater = updater
            self._rust = False
        self._optimizer = optimizer
        self._scaling = None
        if self._native_store is not None:
            self._native_store.set_optimizer(optimizer)

    def _use_worker_updater(self, optimizer):
        """A dist_sync store with an optimizer the servers cannot run (MXNet's
        'test' optimizer, a Python subclass): the servers keep summing, and
        each worker runs MXNet's updater on the sum, as update_on_kvstore=False
        would. Weights already initialized are pulled from the servers first."""
        weights = {}
        for k, (shape, dtype) in self._shapes.items():
            value = np.empty(shape, dtype)
            self._store.pull(k, out=[value])
            weights[k] = mx.nd.array(value, dtype=dtype)
        self._weights = weights
        self._pending = set()
        self._worker_updater = mx.optimizer.get_updater(optimizer)
        self._updater = self._worker_updater
        self._optimizer = optimizer
        self._rust = False
        self._scaling = None

    def set_updater(self, updater):
        """MXNet's ``_set_updater``: ``updater(key, merged, stored)`` on
        NDArrays, ``stored`` updated in place, run on every push (local,
        device and all-reduce stores)."""
        if not callable(updater):
            raise Error("updater must be callable")
        self._store.set_updater(lambda key, merged, stored: _run_mxnet_updater(updater, key, merged, stored,
                                                                               self._dtype(key)))
        self._updater = updater
        self._optimizer = None
        self._rust = False
        if self._native_store is not None:
            self._native_store._set_updater(updater)

    _set_updater = set_updater

    def _dtype(self, key):
        """The dtype a key was initialized with (float16 keys are held in
        float32 by the Rust store, values exact)."""
        return self._shapes.get(key, (None, np.dtype(np.float32)))[1]

    def _before_update(self, key):
        """Bring the Rust optimizer's per-key rates and gradient scaling up to
        date with the MXNet optimizer, exactly when MXNet's updater would read them."""
        if not self._rust or self._dist:
            return
        opt = self._optimizer
        scaling = (opt.rescale_grad, opt.clip_gradient)
        if scaling != self._scaling:
            self._store.set_grad_scaling(opt.rescale_grad, opt.clip_gradient)
            self._scaling = scaling
        for k in (key if isinstance(key, (list, tuple)) else [key]):
            opt._update_count(k)
            self._store.set_rates(k, opt._get_lr(k), opt._get_wd(k))

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """MXNet's checkpoint of the store's optimizer, with gradpack's
        compression states (residuals, scheme state) in the same file, so a
        resumed job continues exactly. A dist store whose optimizer runs on
        its servers cannot save it from a worker (as in MXNet): use
        ``save_compression_states`` for the worker's part."""
        if self._updater is None:
            raise Error("this store has no optimizer: call set_optimizer first")
        if self._dist and self._rust:
            raise Error("the optimizer states of a '%s' store live on its servers and cannot be saved from a "
                        "worker (as in MXNet); save_compression_states saves this worker's compression state"
                        % self._name)
        if self._rust:
            payload = {"gradpack_states": self._store.optimizer_states(),
                       "optimizer": self._optimizer if dump_optimizer else None,
                       "index_update_count": dict(self._optimizer._index_update_count)}
        else:
            payload = _gradpack_payload_of(self._updater.get_states(dump_optimizer), self._store)
        with open(fname, "wb") as f:
            pickle.dump(payload, f)

    def load_optimizer_states(self, fname):
        if self._updater is None:
            raise Error("this store has no optimizer: call set_optimizer first")
        if self._dist and self._rust:
            raise Error("the optimizer states of a '%s' store live on its servers and cannot be loaded from a "
                        "worker (as in MXNet); load_compression_states loads this worker's compression state"
                        % self._name)
        with open(fname, "rb") as f:
            data = f.read()
        if self._rust:
            try:
                payload = pickle.loads(data)
                blob = payload["gradpack_states"]
            except Exception:
                raise Error("%s is not a gradpack optimizer-state file" % fname) from None
            self._store.set_optimizer_states(blob)
            if payload.get("optimizer") is not None:
                self._optimizer = payload["optimizer"]
                self._updater.optimizer = self._optimizer
                self._scaling = None
            self._optimizer._index_update_count.update(payload.get("index_update_count", {}))
            return
        payload = _gradpack_payload(data)
        if payload is None:
            self._updater.set_states(data)  # MXNet's own format (no compression state)
            return
        self._store.set_compression_states(payload["gradpack_compression"])  # checked whole first
        self._updater.set_states(payload["mxnet_states"])

    def save_compression_states(self, fname):
        """This store's compression states alone (on a dist store: this
        worker's), for stores whose optimizer states cannot be saved here."""
        with open(fname, "wb") as f:
            f.write(self._store.compression_states())

    def load_compression_states(self, fname):
        with open(fname, "rb") as f:
            self._store.set_compression_states(f.read())


def _gradpack_payload_of(mxnet_states, store):
    """What ``_gradpack_payload`` reads back: MXNet's updater states beside
    the gradpack store's (``gradpack.kv``'s) compression states."""
    return {"mxnet_states": mxnet_states, "gradpack_compression": store.compression_states()}


def _gradpack_payload(data):
    """The dict ``save_optimizer_states`` (or gradpack's Trainer) wrote around
    MXNet's updater states, or None for MXNet's own format."""
    try:
        payload = pickle.loads(data)
    except Exception:
        return None
    if isinstance(payload, dict) and "gradpack_compression" in payload and "mxnet_states" in payload:
        return payload
    return None


def _run_mxnet_updater(updater, key, merged, stored, dtype):
    """MXNet's updater on NDArrays of the key's dtype: for a float16 key it
    sees float16 weight and gradient, so its multi_precision handling (a
    float32 master copy in its state) is MXNet's own."""
    grad = mx.nd.array(merged, dtype=dtype)
    weight = mx.nd.array(stored, dtype=dtype)
    updater(key, grad, weight)
    stored[...] = weight.asnumpy()


for _name, _method in list(vars(GradpackStore).items()):
    if callable(_method) and not isinstance(_method, type) and (not _name.startswith("__") or _name == "__init__"):
        setattr(GradpackStore, _name, _mxnet_errors(_method))


def _register(name):
    cls = type(name, (GradpackStore,), {
        "__init__": lambda self: GradpackStore.__init__(self, name.split("_", 1)[1]),
        "__doc__": "gradpack's '%s' store, registered as mx.kv.create('%s')." % (name.split("_", 1)[1], name),
    })
    mx.kv.KVStoreBase.register(cls)
    return cls


for _t in _STORE_TYPES:
    _register("gradpack_" + _t)


def create(name="local"):
    """``mx.kv.create`` after ``install()``: gradpack's store of that type
    ('local', 'device', 'dist_sync', 'dist_async', 'dist_sync_device',
    'dist_device_sync', 'dist_sync_allreduce', also spelled 'gradpack_<type>')."""
    if not isinstance(name, str):
        raise TypeError("name must be a string")
    lowered = name.lower()
    if lowered.startswith("gradpack_"):
        lowered = lowered[len("gradpack_"):]
    if lowered in _STORE_TYPES:
        return GradpackStore(lowered)
    # Every other name (local_allreduce_cpu, nccl, horovod, a user's
    # KVStoreBase plugin, ...) is MXNet's, unchanged.
    from . import _saved
    native = _saved[(mx.kv, "create")] if _saved else mx.kv.create
    return native(name)
