"""gradpack.kv: KVStores with MXNet's API over numpy arrays.

``gradpack.kv.create('device')`` returns a store whose ``init``, ``push``,
``pull``, ``pushpull``, ``broadcast`` take the same arguments as MXNet's
``mx.kv.KVStore``: keys are ints or strings (or lists of them), values are
arrays or lists of arrays (one per device). float32 or float16 values (a
float16 key keeps MXNet's float16 semantics: see the README); float16 and
bfloat16 gradients are accepted when compressing. Arrays are passed to the
Rust core without copies; outputs are written in place.
"""
import atexit
import contextlib
import ctypes
import os
import sys
import weakref
from collections import OrderedDict

import numpy as np

from .base import DTYPES, LIB, Error, NativeHandle, check_call

__all__ = ["create", "KVStore"]

_u64p = ctypes.POINTER(ctypes.c_uint64)


class _Key(ctypes.Structure):
    _fields_ = [("int_key", ctypes.c_int64), ("str_key", ctypes.c_char_p)]


class _Array(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", _u64p)]


class _ArrayMut(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("ndim", ctypes.c_int), ("shape", _u64p)]


_UPDATER = ctypes.CFUNCTYPE(ctypes.c_int, _Key, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                            ctypes.c_void_p)
_p = ctypes.c_void_p
_int = ctypes.c_int
LIB.gp_kvstore_new.argtypes = [ctypes.c_char_p, ctypes.POINTER(_p)]
LIB.gp_kvstore_free.argtypes = [_p]
LIB.gp_kvstore_free.restype = None
LIB.gp_kvstore_close.argtypes = [_p]
LIB.gp_kvstore_type.argtypes = [_p]
LIB.gp_kvstore_type.restype = ctypes.c_char_p
LIB.gp_kvstore_init.argtypes = [_p, _Key, _Array]
LIB.gp_kvstore_push.argtypes = [_p, _Key, ctypes.POINTER(_Array), _int]
LIB.gp_kvstore_pull.argtypes = [_p, _Key, ctypes.POINTER(_ArrayMut), _int]
LIB.gp_kvstore_pushpull.argtypes = [_p, _Key, ctypes.POINTER(_Array), _int,
                                    ctypes.POINTER(_ArrayMut), _int]
LIB.gp_kvstore_broadcast.argtypes = [_p, _Key, _Array, ctypes.POINTER(_ArrayMut), _int]
LIB.gp_kvstore_refuse.argtypes = [_p, ctypes.POINTER(_Key), _int, ctypes.POINTER(ctypes.c_uint64), _int,
                                  ctypes.c_char_p]
_strs = ctypes.POINTER(ctypes.c_char_p)
LIB.gp_kvstore_set_compress.argtypes = [_p, _strs, _strs, _int]
LIB.gp_kvstore_set_optimizer.argtypes = [_p, ctypes.c_char_p, _strs, _strs, _int]
LIB.gp_kvstore_set_rates.argtypes = [_p, _Key, ctypes.c_double, ctypes.c_double]
LIB.gp_kvstore_set_grad_scaling.argtypes = [_p, ctypes.c_float, ctypes.c_float]
LIB.gp_kvstore_set_updater.argtypes = [_p, _UPDATER, _p]
LIB.gp_kvstore_save_optimizer_states.argtypes = [_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint8)),
                                                 ctypes.POINTER(ctypes.c_uint64)]
LIB.gp_kvstore_load_optimizer_states.argtypes = [_p, ctypes.c_char_p, ctypes.c_uint64]
LIB.gp_kvstore_save_compression_states.argtypes = LIB.gp_kvstore_save_optimizer_states.argtypes
LIB.gp_kvstore_load_compression_states.argtypes = [_p, ctypes.c_char_p, ctypes.c_uint64]
LIB.gp_buffer_free.argtypes = [ctypes.POINTER(ctypes.c_uint8), ctypes.c_uint64]
LIB.gp_buffer_free.restype = None
LIB.gp_kvstore_residual.argtypes = [_p, _Key, ctypes.c_uint64, ctypes.POINTER(ctypes.c_float), ctypes.c_uint64]
LIB.gp_kvstore_stats.argtypes = [_p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
LIB.gp_kvstore_dropped.argtypes = [_p, ctypes.POINTER(ctypes.c_uint64)]
LIB.gp_kvstore_local_pulls.argtypes = [_p, ctypes.POINTER(ctypes.c_uint64)]
LIB.gp_kvstore_rank.argtypes = [_p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
LIB.gp_kvstore_barrier.argtypes = [_p]
LIB.gp_dist_serve.argtypes = []

# Distributed workers leave the job when the process ends, even if the store
# object is still referenced then.
_open_stores = weakref.WeakSet()
# All-reduce stores, in the order this worker created them (every worker
# creates them in the same order): at exit they close collectively in that
# order, so that a worker still waiting in a push of its own gets an error.
_collective_stores = []


@atexit.register
def _close_open_stores():
    for ref in _collective_stores:
        store = ref()
        if store is not None and store.handle:
            try:
                store.close()
            except Error as e:
                print("gradpack: closing a '%s' store at exit: %s" % (ALLREDUCE_TYPE, e), file=sys.stderr)
    for store in list(_open_stores):
        store.close()


LIB.gp_kvstore_types.argtypes = []
LIB.gp_kvstore_types.restype = ctypes.c_char_p
# The Rust core's one table of store types: (name, kind) in its order.
_TYPES = [tuple(entry.split(":")) for entry in LIB.gp_kvstore_types().decode().split(",")]
STORE_TYPES = tuple(name for name, _ in _TYPES)
DIST_TYPES = tuple(name for name, kind in _TYPES if kind == "dist")
# MXNet's name for its MPI store: workers only, launched with mpirun; each
# worker updates its own replica, so it behaves like a local store otherwise.
ALLREDUCE_TYPE = next(name for name, kind in _TYPES if kind == "allreduce")


def create(name="local"):
    """Create a KVStore: 'local', 'device', one of the parameter-server types
    ('dist_sync', 'dist_async', 'dist_sync_device', 'dist_device_sync'), or
    'dist_sync_allreduce' (MPI: run the script with mpirun).

    As in MXNet, a process launched with DMLC_ROLE=server or scheduler serves
    as soon as it creates a distributed store, and exits when the job ends."""
    if isinstance(name, str) and name in DIST_TYPES:
        role = os.environ.get("DMLC_ROLE", "worker").strip()
        if role in ("server", "scheduler"):
            serve_and_exit()
    return KVStore(name)


def serve_and_exit():
    """Run this process's DMLC_ROLE (server or scheduler) until the job ends,
    then exit: status 0 when it ended normally, 1 when it failed."""
    status = LIB.gp_dist_serve()
    if status != 0:
        sys.stderr.write("gradpack %s: %s\n" % (os.environ.get("DMLC_ROLE", "").strip(),
                                                  LIB.gp_error_last().decode("utf-8", "replace")))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if status == 0 else 1)


_INT_KEY_MIN, _INT_KEY_MAX = -(1 << 63), (1 << 63) - 1


def _key(k):
    """A key for the C ABI. ctypes would wrap an int modulo 2^64 and cut a str
    at NUL, each onto another key: both are refused here."""
    if isinstance(k, (bool, np.bool_)):
        raise Error("key %r: keys must be int or str" % (k,))
    if isinstance(k, (int, np.integer)):
        if not _INT_KEY_MIN <= int(k) <= _INT_KEY_MAX:
            raise Error("key %d: int keys must fit in a signed 64-bit integer" % int(k))
        return _Key(int(k), None)
    if isinstance(k, str):
        if "\0" in k:
            raise Error("key %r: string keys cannot contain NUL (found at index %d)" % (k, k.index("\0")))
        return _Key(0, k.encode("utf-8"))
    raise Error("key %r: keys must be int or str, got %s" % (k, type(k).__name__))


def _shape(a):
    return (ctypes.c_uint64 * max(a.ndim, 1))(*a.shape)


def _array_in(key, a, what):
    if not isinstance(a, np.ndarray):
        raise Error("key %r: %s must be a numpy.ndarray, got %s" % (key, what, type(a).__name__))
    if a.dtype.name not in DTYPES:
        raise Error("key %r: %s has dtype %s, expected float32 or float16 (bfloat16 gradients "
                    "when compressing)" % (key, what, a.dtype.name))
    a = np.ascontiguousarray(a)  # a copy only for non-contiguous inputs, which are read-only here
    shape = _shape(a)
    return _Array(a.ctypes.data, DTYPES[a.dtype.name], a.ndim, shape), (a, shape)


def _array_out(key, a, what):
    """The C view of an output, and what keeps it alive. A float16 output (of
    a float16 key) is written through a float32 buffer, cast when the call
    succeeded (`_finish_outputs`); the values are float16 already."""
    if not isinstance(a, np.ndarray):
        raise Error("key %r: %s must be a numpy.ndarray, got %s" % (key, what, type(a).__name__))
    if a.dtype not in (np.float32, np.float16):
        raise Error("key %r: %s has dtype %s, expected float32 (or float16 for a float16 key)"
                    % (key, what, a.dtype.name))
    if not a.flags.c_contiguous:
        raise Error("key %r: %s must be C-contiguous (it is written in place)" % (key, what))
    if not a.flags.writeable:
        raise Error("key %r: %s is read-only" % (key, what))
    shape = _shape(a)
    target = a
    if a.dtype == np.float16:
        a = np.empty(a.shape, np.float32)
    return _ArrayMut(a.ctypes.data, a.ndim, shape), (shape, a, target)


def _shape_of(vals):
    """The shape of an init's value, when it is an array."""
    return tuple(vals[0].shape) if vals and isinstance(vals[0], np.ndarray) else None


def _finish_outputs(made):
    for _, (_, written, target) in made:
        if written is not target:
            target[...] = written


def _c_strings(items):
    """A ctypes array of byte strings (at least one slot, as C wants a valid
    pointer). ctypes would cut a string at a NUL, onto another name or
    setting: one holding a NUL is refused."""
    items = list(items)
    for item in items:
        if b"\0" in item:
            raise Error("%r holds a NUL character (at index %d): gradpack's names and settings cannot"
                        % (item.decode("utf-8", "replace"), item.index(b"\0")))
    return (ctypes.c_char_p * max(len(items), 1))(*items)


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _grouped(key, value, what):
    """MXNet's pairing: one key with an array or a list (devices), or a list of
    keys with a list of such values; repeated keys are grouped in order."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise Error("%d keys need a list of %d %s, got %s" % (
                len(key), len(key), what,
                "%d" % len(value) if isinstance(value, (list, tuple)) else type(value).__name__))
        groups = OrderedDict()
        for k, v in zip(key, value):
            groups.setdefault(k if not isinstance(k, np.integer) else int(k), []).extend(_as_list(v))
        return list(groups.items())
    return [(key, _as_list(value))]


class KVStore(NativeHandle):
    """A local or device store (see the module doc). Not copyable or
    picklable (it owns the native store): create another and carry state
    over with pull/init and compression_states()/set_compression_states()."""

    _instead = ("create another store with gradpack.kv.create() and carry its values over with pull()/init(), "
                "its states with optimizer_states()/set_optimizer_states() and "
                "compression_states()/set_compression_states()")

    def __init__(self, name="local"):
        if not isinstance(name, str):
            raise Error("store type must be a string, got %r" % (name,))
        handle = ctypes.c_void_p()
        check_call(LIB.gp_kvstore_new(name.encode(), ctypes.byref(handle)))
        self.handle = handle
        self._dist = name in DIST_TYPES
        if self._dist:
            _open_stores.add(self)
        if name == ALLREDUCE_TYPE:
            _collective_stores.append(weakref.ref(self))
        self._updater = None
        self._updater_error = None
        self._shapes = {}

    def close(self):
        """Close and release the store: a distributed worker leaves the job;
        a 'dist_sync_allreduce' store closes together with every other
        worker, so that one still waiting in a push gets an error instead of
        waiting forever."""
        handle = getattr(self, "handle", None)
        if handle:
            status = LIB.gp_kvstore_close(handle)
            message = LIB.gp_error_last().decode("utf-8", "replace") if status != 0 else None
            LIB.gp_kvstore_free(handle)
            self.handle = None
            if message is not None:
                raise Error(message)

    def __del__(self):
        # Release only: garbage collection runs at different times on each
        # worker, so it must not take part in a collective close.
        handle = getattr(self, "handle", None)
        if handle:
            LIB.gp_kvstore_free(handle)
            self.handle = None

    @property
    def type(self):
        return LIB.gp_kvstore_type(self.handle).decode()

    def _rank(self):
        rank, num = ctypes.c_uint64(), ctypes.c_uint64()
        self._call(LIB.gp_kvstore_rank(self.handle, ctypes.byref(rank), ctypes.byref(num)))
        return rank.value, num.value

    @property
    def rank(self):
        return self._rank()[0]

    @property
    def num_workers(self):
        return self._rank()[1]

    def barrier(self):
        """Wait until every worker reached the barrier (a no-op for local stores)."""
        self._call(LIB.gp_kvstore_barrier(self.handle))

    def _call(self, status):
        err, self._updater_error = self._updater_error, None
        if status != 0 and err is not None:
            raise err
        check_call(status)

    @contextlib.contextmanager
    def _refusing(self, k, init, shape=None):
        """This front's own checks of one key's init or push: a refusal still
        takes part in the call on an all-reduce store (gp_kvstore_refuse),
        so that every other worker's call fails alike, naming it, instead of
        pairing with this worker's next call."""
        try:
            yield
        except Error as e:
            try:
                key = ctypes.byref(_key(k))
            except Error:
                key = None
            dims = (ctypes.c_uint64 * max(len(shape), 1))(*shape) if shape is not None else None
            LIB.gp_kvstore_refuse(self.handle, key, int(init), dims, len(shape or ()),
                                  str(e).replace("\0", "\\0").encode("utf-8", "replace"))
            raise

    def init(self, key, value):
        """Initialise one key (or a list) with float32 or float16 values; lossless."""
        for k, vals in _grouped(key, value, "values"):
            with self._refusing(k, True, _shape_of(vals)):
                if len(vals) != 1:
                    raise Error("key %r: init takes one value, got %d" % (k, len(vals)))
                arr, keep = _array_in(k, vals[0], "init value")
                c_key = _key(k)
            self._call(LIB.gp_kvstore_init(self.handle, c_key, arr))
            self._shapes[k] = np.shape(vals[0])

    def push(self, key, value, priority=0):
        """Push values (one per device) for one key or a list of keys."""
        for k, vals in _grouped(key, value, "values"):
            with self._refusing(k, False):
                arrs, keep = self._arrays_in(k, vals, "pushed value")
                c_key = _key(k)
            self._call(LIB.gp_kvstore_push(self.handle, c_key, arrs, len(vals)))

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Copy the stored value(s) into ``out`` (an array or a list per key)."""
        if out is None:
            raise Error("pull needs out= (an array or a list of arrays)")
        for k, outs in _grouped(key, out, "outputs"):
            arrs, keep = self._arrays_out(k, outs, "pull output")
            self._call(LIB.gp_kvstore_pull(self.handle, _key(k), arrs, len(outs)))
            _finish_outputs(keep)

    def pushpull(self, key, value, out=None, priority=0):
        """Push, then pull into ``out`` (into ``value`` itself when out is None)."""
        out = value if out is None else out
        pairs_in = _grouped(key, value, "values")
        pairs_out = dict(_grouped(key, out, "outputs"))
        for k, vals in pairs_in:
            with self._refusing(k, False):
                arrs, keep_in = self._arrays_in(k, vals, "pushed value")
                if k not in pairs_out:
                    raise Error("key %r: pushpull has no output for it" % (k,))
                outs, keep_out = self._arrays_out(k, pairs_out[k], "pushpull output")
                c_key = _key(k)
            self._call(LIB.gp_kvstore_pushpull(self.handle, c_key, arrs, len(vals), outs,
                                               len(pairs_out[k])))
            _finish_outputs(keep_out)

    def broadcast(self, key, value, out, priority=0):
        """Initialise with ``value``, then pull into ``out``."""
        pairs_out = dict(_grouped(key, out, "outputs"))
        for k, vals in _grouped(key, value, "values"):
            with self._refusing(k, True, _shape_of(vals)):
                if len(vals) != 1:
                    raise Error("key %r: broadcast takes one value, got %d" % (k, len(vals)))
                arr, keep = _array_in(k, vals[0], "broadcast value")
                if k not in pairs_out:
                    raise Error("key %r: broadcast has no output for it" % (k,))
                outs, keep_out = self._arrays_out(k, pairs_out[k], "broadcast output")
                c_key = _key(k)
            self._call(LIB.gp_kvstore_broadcast(self.handle, c_key, arr, outs, len(pairs_out[k])))
            _finish_outputs(keep_out)
            self._shapes[k] = np.shape(vals[0])

    def _arrays_in(self, k, vals, what):
        made = [_array_in(k, v, "%s %d" % (what, i)) for i, v in enumerate(vals)]
        arrs = (_Array * max(len(made), 1))(*[m[0] for m in made])
        return arrs, made

    def _arrays_out(self, k, outs, what):
        made = [_array_out(k, o, "%s %d" % (what, i)) for i, o in enumerate(outs)]
        arrs = (_ArrayMut * max(len(made), 1))(*[m[0] for m in made])
        return arrs, made

    # ----------------------------------------------------------- configuration

    def set_compress(self, compress_params):
        """Gradient compression (docs/contract.md §2), e.g. {'compress': '2bit',
        'pos_threshold': 0.5, 'neg_threshold': -0.5}. A 'local' store refuses it."""
        if not isinstance(compress_params, dict):
            raise Error("compress_params must be a dict, got %s" % type(compress_params).__name__)
        keys = [str(k).encode() for k in compress_params]
        vals = [str(v).encode() for v in compress_params.values()]
        self._call(LIB.gp_kvstore_set_compress(self.handle, _c_strings(keys), _c_strings(vals), len(keys)))

    def set_gradient_compression(self, compression_params):
        """MXNet 1.x's spelling of set_compress."""
        self.set_compress(compression_params)

    def set_optimizer(self, optimizer, **params):
        """Run gradpack's optimizer on every push: ``set_optimizer('sgd',
        learning_rate=0.1, momentum=0.9)`` or a dict with a 'name' key.
        Known: 'sgd', 'nag', 'adam' with MXNet's parameter names, and
        ``multi_precision`` (a float32 master copy for float16 keys)."""
        if isinstance(optimizer, dict):
            params = dict(optimizer, **params)
            optimizer = params.pop("name", None)
        if not isinstance(optimizer, str):
            raise Error("set_optimizer takes an optimizer name ('sgd', 'nag', 'adam') or a dict "
                        "with 'name', got %s" % type(optimizer).__name__)
        keys = [k.encode() for k in params]
        def text(v):
            if v is None:
                return "none"
            if isinstance(v, (bool, np.bool_)):
                return "true" if v else "false"
            return v if isinstance(v, str) else repr(float(v))
        vals = [text(v).encode() for v in params.values()]
        self._call(LIB.gp_kvstore_set_optimizer(self.handle, optimizer.encode(), _c_strings(keys),
                                                _c_strings(vals), len(keys)))

    def set_rates(self, key, learning_rate, wd):
        """One key's learning rate and weight decay for the optimizer set here
        (what MXNet's optimizer ``_get_lr(key)`` / ``_get_wd(key)`` return)."""
        self._call(LIB.gp_kvstore_set_rates(self.handle, _key(key), learning_rate, wd))

    def set_grad_scaling(self, rescale_grad, clip_gradient=None):
        """The optimizer's rescale_grad and clip_gradient (None: off)."""
        clip = -1.0 if clip_gradient is None else clip_gradient
        self._call(LIB.gp_kvstore_set_grad_scaling(self.handle, rescale_grad, clip))

    def set_updater(self, updater):
        """Call ``updater(key, merged, stored)`` on every push (numpy arrays,
        ``stored`` updated in place) instead of storing the merged sum."""
        if not callable(updater):
            raise Error("updater must be callable")

        def trampoline(ckey, merged_ptr, stored_ptr, n, _user):
            try:
                key = ckey.str_key.decode("utf-8") if ckey.str_key is not None else ckey.int_key
                shape = self._shapes.get(key, (n,))
                merged = np.ctypeslib.as_array((ctypes.c_float * n).from_address(merged_ptr)).reshape(shape)
                stored = np.ctypeslib.as_array((ctypes.c_float * n).from_address(stored_ptr)).reshape(shape)
                merged.flags.writeable = False
                updater(key, merged, stored)
                return 0
            except BaseException as e:  # re-raised on the pushing thread after the call
                self._updater_error = e
                return -1

        self._updater = _UPDATER(trampoline)  # kept alive as long as the store
        self._call(LIB.gp_kvstore_set_updater(self.handle, self._updater, None))

    _set_updater = set_updater

    def _blob(self, fn):
        data = ctypes.POINTER(ctypes.c_uint8)()
        n = ctypes.c_uint64()
        self._call(fn(self.handle, ctypes.byref(data), ctypes.byref(n)))
        try:
            return ctypes.string_at(data, n.value)
        finally:
            LIB.gp_buffer_free(data, n)

    def optimizer_states(self):
        """The store's states as bytes (gradpack's own versioned format): its
        optimizer's states and its compression states (residuals, scheme
        state), so that a resumed job continues exactly."""
        return self._blob(LIB.gp_kvstore_save_optimizer_states)

    def set_optimizer_states(self, blob):
        """Replace the states with bytes from ``optimizer_states()``; checked
        whole first, so a blob that does not fit changes nothing."""
        self._call(LIB.gp_kvstore_load_optimizer_states(self.handle, blob, len(blob)))

    def compression_states(self):
        """Every key's compression state as bytes: residuals per device (or,
        on a dist worker, per server slice) and scheme state. Each worker of
        a distributed job saves and loads its own."""
        return self._blob(LIB.gp_kvstore_save_compression_states)

    def set_compression_states(self, blob):
        """Replace the compression states with bytes from
        ``compression_states()``. Another compression, rank or key shape is
        an error naming it, and changes nothing; keys not in the blob start
        afresh."""
        self._call(LIB.gp_kvstore_load_compression_states(self.handle, blob, len(blob)))

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Write the optimizer states to ``fname``."""
        blob = self.optimizer_states()
        with open(fname, "wb") as f:
            f.write(blob)

    def load_optimizer_states(self, fname):
        """Replace the optimizer states with those saved in ``fname``."""
        with open(fname, "rb") as f:
            self.set_optimizer_states(f.read())

    def residual(self, key, device=0):
        """The error-feedback residual of ``key`` on ``device`` (2-bit's or a
        scheme's), as a new array; an error for a device that has not pushed
        the key with compression."""
        size = int(np.prod(self._shapes[key])) if key in self._shapes else None
        if size is None:
            raise Error("key %r: not initialized (call init first)" % (key,))
        out = np.zeros(self._shapes[key], np.float32)
        self._call(LIB.gp_kvstore_residual(self.handle, _key(key), device,
                                           out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), size))
        return out

    def stats(self):
        """Traffic. Local stores: bytes pushes moved between devices as float32
        ('raw_bytes') and as counted when handed over ('wire_bytes': the
        devices' arrays, their packed 2-bit buffers, or what each handed the
        scheme's group, counted as MPI gets it); 'dist_sync_allreduce': the
        same for what this worker handed to MPI. Parameter-server workers: this
        node's transport payload bytes ('bytes_sent', 'bytes_received') and
        the messages it dropped ('dropped': unauthenticated, replayed,
        malformed or unexpected) and the pulls it answered from the values its
        last scheme rounds brought back, asking no server ('local_pulls')."""
        a, b = ctypes.c_uint64(), ctypes.c_uint64()
        self._call(LIB.gp_kvstore_stats(self.handle, ctypes.byref(a), ctypes.byref(b)))
        if self._dist:
            dropped, local = ctypes.c_uint64(), ctypes.c_uint64()
            self._call(LIB.gp_kvstore_dropped(self.handle, ctypes.byref(dropped)))
            self._call(LIB.gp_kvstore_local_pulls(self.handle, ctypes.byref(local)))
            return {"bytes_sent": a.value, "bytes_received": b.value, "dropped": dropped.value, "local_pulls": local.value}
        return {"raw_bytes": a.value, "wire_bytes": b.value}
