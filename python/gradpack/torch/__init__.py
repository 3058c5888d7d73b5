"""gradpack.torch: gradpack's schemes as DDP communication hooks over
torch.distributed (gloo on CPU).

    import gradpack.torch as gpt
    state = gpt.State({'compress': 'qsgd_mn', 'bits': 2, 'seed': 1})
    ddp.register_comm_hook(state, gpt.hook)

The Rust core does every numeric step (the stores' scheme path); this
module hands it the bucket's float32 buffer without copying and performs
the all-reduces it asks for, every one issued from the hook body in the
same order on every rank (the schemes' exchanges block there; the final
sums are asynchronous and decoded in the future's callback, or by the
step's last hook). A bucket is checked with every rank at the end of its
final sum, not in a round of its own, once the State knows which bucket
comes next (src/store/group/mod.rs). Results are the sum over ranks
divided by the world size, identical on every rank.

Each parameter is one key ('param0', 'param1', ... in the order DDP first
hands them over), so state survives DDP's bucket rebuilds and checkpoints.
Errors are ``gradpack.Error``, raised on every rank at the same step (by
the hook of the step's last bucket when a bucket's final sum found it),
with every state of the step as it was: a step's buckets commit together
at its last bucket. Input one rank refuses still takes its part in the
exchange, so every rank raises. A
rank that dies ends the job with torch's own timeout error (the
``timeout=`` of ``init_process_group``).
"""
import ctypes
import hashlib
import math
import threading

import torch
import torch.distributed as dist

from ..base import LIB, Error, NativeHandle, check_call

__all__ = ["State", "hook", "allreduce_"]

_p = ctypes.c_void_p
_u64 = ctypes.c_uint64
_REDUCE = ctypes.CFUNCTYPE(ctypes.c_int, _p, ctypes.c_int, ctypes.c_int, _p, _u64)
_strs = ctypes.POINTER(ctypes.c_char_p)
LIB.gp_group_new.argtypes = [_strs, _strs, ctypes.c_int, _u64, _u64, _u64, ctypes.c_double,
                             ctypes.c_char_p, ctypes.POINTER(_p)]
LIB.gp_group_free.argtypes = [_p]
LIB.gp_group_free.restype = None
LIB.gp_group_encode.argtypes = [_p, _u64, _strs, ctypes.POINTER(_u64), ctypes.POINTER(_u64), _p,
                                _u64, ctypes.c_int, _u64, _REDUCE, _p, ctypes.POINTER(_p),
                                ctypes.POINTER(_p), ctypes.POINTER(_u64), ctypes.POINTER(_p),
                                ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_int)]
LIB.gp_group_decode_held.argtypes = [_p, _p, _p, _u64]
LIB.gp_group_commit.argtypes = [_p, _p]
LIB.gp_group_refuse.argtypes = [_p, _u64, _strs, ctypes.POINTER(_u64), ctypes.POINTER(_u64), ctypes.c_int, _u64,
                                _REDUCE, _p]
LIB.gp_group_check.argtypes = [_p, _p]
LIB.gp_pending_free.argtypes = [_p]
LIB.gp_pending_free.restype = None
LIB.gp_group_stats.argtypes = [_p, ctypes.POINTER(_u64)]
LIB.gp_group_save.argtypes = [_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint8)), ctypes.POINTER(_u64)]
LIB.gp_group_load.argtypes = [_p, ctypes.c_char_p, _u64]
LIB.gp_buffer_free.argtypes = [ctypes.POINTER(ctypes.c_uint8), _u64]
LIB.gp_buffer_free.restype = None

# The C ABI's buffer codes and reductions.
_BUFFERS = {0: (torch.float32, ctypes.c_float), 1: (torch.int64, ctypes.c_int64)}
_OPS = {0: dist.ReduceOp.SUM, 1: dist.ReduceOp.MAX, 2: dist.ReduceOp.BOR}
_WIDENED = (torch.float16, torch.bfloat16)
_STATE_FORMAT = "gradpack.torch/1"
_TEXT_BYTES = 1024  # an error's text as every rank of a group learns it (`_gather_texts`)


def _view(ptr, n, code):
    """A tensor over gradpack's memory (no copy), valid while its owner lives."""
    dtype, ctype = _BUFFERS[code]
    if n == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctype * n).from_address(ptr), dtype=dtype)


_U64_MAX = (1 << 64) - 1


def _c_text(value, what):
    """``str(value)`` for the C ABI, which would cut it at a NUL (onto
    another name or setting): a NUL is refused."""
    text = str(value)
    if "\0" in text:
        raise Error("%s %r holds a NUL character (at index %d): gradpack's names and settings cannot"
                    % (what, text, text.index("\0")))
    return text.encode()


def _check_tensor(t, what):
    if not isinstance(t, torch.Tensor):
        raise Error("%s must be a torch.Tensor, got %s" % (what, type(t).__name__))
    if t.device.type != "cpu":
        raise Error("%s is on %s: gradpack.torch compresses CPU tensors only in this build "
                    "(train on CPU with the gloo backend)" % (what, t.device))
    if t.dtype != torch.float32 and t.dtype not in _WIDENED:
        raise Error("%s has dtype %s: gradpack compresses float32, float16 and bfloat16 "
                    "gradients" % (what, t.dtype))


class _Pending(NativeHandle):
    """A bucket between encode and decode: its float32 view and the
    all-reduces in flight. Decoded once (by the hook's callback, or by
    whoever needs it first), which writes the result and changes no state;
    then committed (its states advance) or abandoned (they stay as they
    were): a step's buckets are committed together once every one of them
    decoded, so a step that fails anywhere changes no state. Never copied."""

    _instead = "a pending bucket is decoded once, by the hook call that made it"

    def __init__(self, state, handle, flat, keys, words, nwords, floats, nfloats, plain):
        self.state, self.handle, self.flat, self.keys = state, handle, flat, keys
        self._lock, self._outcome, self._decoded = threading.Lock(), None, False
        # The words (ending with the bucket's check) first, then the floats
        # or the bucket itself: the order every rank sums them in.
        sums = [_view(words, nwords, 1), flat if plain else _view(floats, nfloats, 0)]
        group = state._comm
        self.futures = []
        try:
            for t in sums:
                if t.numel() > 0:
                    self.futures.append(dist.all_reduce(t, group=group, async_op=True).get_future())
        except BaseException:
            self._wait()  # a sum already in flight writes gradpack's buffers: wait for it before they go
            raise
        for k in keys:
            state._open[k] = self
        state._pending.append(self)

    def _wait(self):
        """Waits for every sum in flight; returns the first one's error."""
        first = None
        for f in self.futures:
            try:
                f.wait()
            except Exception as e:  # noqa: BLE001 - the caller raises it
                first = first or e
        return first

    def decode(self):
        """Writes the summed bucket's result into its buffer once, changing
        no state; raises its error (every later call raises it again). A
        failed bucket is dropped (its states as they were) but stays listed
        for the step's last hook to raise."""
        with self._lock:
            if self.handle is not None and not self._decoded:
                try:
                    check_call(LIB.gp_group_decode_held(self.state._handle, self.handle, self.flat.data_ptr(),
                                                        self.flat.numel()))
                    self._decoded = True
                except Error as e:
                    self._outcome = e
                    handle, self.handle = self.handle, None
                    LIB.gp_pending_free(handle)
                    self._release_keys()
            if self._outcome is not None:
                raise self._outcome

    def commit(self):
        """Advances the decoded bucket's states and returns its keys."""
        with self._lock:
            if self.handle is None or not self._decoded:
                raise Error("gradpack.torch: a pending bucket committed before it was decoded")
            handle, self.handle = self.handle, None
            self._release_keys()
            if self in self.state._pending:
                self.state._pending.remove(self)
            check_call(LIB.gp_group_commit(self.state._handle, handle))

    def check(self):
        """Raises the error decode would raise, changing nothing (the sums
        have arrived)."""
        with self._lock:
            if self.handle is None or self._decoded:
                raise Error("a pending bucket checked after it was decoded")
            check_call(LIB.gp_group_check(self.state._handle, self.handle))

    def abandon(self):
        """Drops the bucket, decoded or not, once its sums in flight have
        arrived: its keys' states stay as they were."""
        self._wait()
        with self._lock:
            handle, self.handle = self.handle, None
            self._release_keys()
            if self in self.state._pending:
                self.state._pending.remove(self)
        if handle is not None:
            LIB.gp_pending_free(handle)

    def _release_keys(self):
        """Its keys are no longer in flight (under the lock)."""
        for k in self.keys:
            if self.state._open.get(k) is self:
                del self.state._open[k]

    def settle(self, raising=False):
        """Waits for every sum and decodes the bucket; its error is raised
        when `raising`, else left for the hook's future to carry."""
        failure = self._wait()
        if failure is not None:
            if raising:
                raise failure
            return
        try:
            self.decode()
        except Error:
            if raising:
                raise

    def __del__(self):
        if getattr(self, "handle", None) is not None:
            LIB.gp_pending_free(self.handle)


class State(NativeHandle):
    """One rank's compression state for a process group.

    ``compress_params`` is the dict the stores take (every scheme:
    'none', '2bit', 'qsgd_mn', 'qsgd_mn_ts', 'qsgd_mn_ms', 'grandk_mn',
    'grandk_mn_ts', 'powersgd', '1bit'). Each tensor is summed plainly
    for its first ``start_iter`` pushes, and compressed only when its bytes
    shrink at least ``min_compression_rate`` times (smaller tensors, and
    vectors under PowerSGD, go as float32).

    ``exchange`` says how compressed codes reach every rank: 'lanes' (the
    default), one all-reduce of lanes wide enough for every rank's sum
    (exact: the device store's bits; the bytes grow with the ranks),
    'owners', an all_to_all that gives each rank 1/world of every rank's
    codes, which it sums and rounds (at random, unbiased) back to one
    rank's codes, then an all_gather (bytes bounded at any world size, at
    a cost in accuracy: docs/torch.md), or 'auto': 'owners' for 2bit, 1bit
    and the QSGD family from 4 ranks where the lanes would take at least
    1.5 times one rank's bits a value, else 'lanes'. PowerSGD and 'none'
    send float32 and always take 'lanes'.

    ``local_size`` (ranks a node) turns on the hierarchical exchange for a
    job of several nodes: a bucket is summed in float32 inside each node
    (``reduce_scatter``, each local rank owning 1/local_size of every
    parameter), each local rank compresses its share across the nodes with
    the ranks of its own local index, and the node gathers the result (``all_gather``). Left
    as None it is torchrun's ``LOCAL_WORLD_SIZE`` when that is smaller than
    the world (several nodes), else the flat exchange; 1 forces the flat
    exchange. The hierarchical exchange needs the default process group and
    ranks numbered node by node (torchrun's). Local rank j owns row block
    j of every parameter, so its states (residuals, PowerSGD's Q) follow
    the parameter through DDP's bucket rebuilds and checkpoints.

    A State owns native state: it cannot be copied or pickled; save it with
    ``state_dict()`` and resume a new State with ``load_state_dict()``.
    """

    _instead = ("save it with state_dict() and load that into a new gradpack.torch.State with "
                "load_state_dict()")

    def __init__(self, compress_params, process_group=None, start_iter=0, min_compression_rate=2.0, local_size=None,
                 exchange="lanes", *, _fsdp=False):
        if not dist.is_available() or not dist.is_initialized():
            raise Error("gradpack.torch.State needs torch.distributed initialised "
                        "(torch.distributed.init_process_group) first")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # Every argument is checked first, and the verdict shared with every
        # rank in local_size's agreement: a bad argument on one rank is the
        # same error on every rank here, not a wait at the first bucket.
        problem, args = None, None
        try:
            args = _state_args(compress_params, start_iter, min_compression_rate, exchange, _fsdp, self.rank,
                               self.world_size)
        except Error as e:
            problem = str(e) or "?"
        self.local_size = _local_size(local_size, process_group, self.rank, self.world_size, problem)
        # The ranks a bucket's compressed exchanges run among: every rank, or
        # (hierarchical) the ranks of this local index on every node.
        self._comm, self._intra, self._intra_bytes = process_group, None, 0
        inner_rank, inner_world = self.rank, self.world_size
        if self.local_size > 1:
            nodes, (node, local) = self.world_size // self.local_size, divmod(self.rank, self.local_size)
            # Every rank creates every group, in one order (new_group is
            # collective), with the default group's timeout (a dead or late
            # rank ends a bucket within init_process_group's timeout, not
            # torch's default of 30 minutes).
            timeout = _timeout_of(dist.distributed_c10d._get_default_group())
            intra = [dist.new_group(list(range(n * self.local_size, (n + 1) * self.local_size)), timeout=timeout)
                     for n in range(nodes)]
            inter = [dist.new_group(list(range(j, self.world_size, self.local_size)), timeout=timeout)
                     for j in range(self.local_size)]
            self._intra, self._comm = intra[node], inter[local]
            inner_rank, inner_world = node, nodes
        self._comm_rank = inner_rank
        # What the ranks of a node must hold alike beside each bucket (the
        # hierarchical exchange compares it before the node's reduce-scatter).
        self._node_settings = repr((sorted((str(k), str(v)) for k, v in dict(compress_params).items()), start_iter,
                                    min_compression_rate, exchange))
        self._digests = {}
        self._scatter = exchange == "scatter"
        self._handle = _new_group(args, inner_rank, inner_world)
        self.compress_params = dict(compress_params)
        self._param_keys = {}  # id(parameter) -> key
        self._params = []  # the parameters, so that their ids stay theirs
        self._failure = None
        self._reduce_fn = _REDUCE(self._reduce)
        self._layouts = {}  # (keys, shapes) -> the C arrays that name them
        self._open = {}  # key -> its bucket not yet decoded
        self._pending = []  # the buckets not yet decoded, in the order they were encoded
        # encode's outputs (the pending bucket and its buffers), kept for every call.
        self._outs = tuple(t() for t in (_p, _p, _u64, _p, _u64, ctypes.c_int))
        self._out_refs = tuple(ctypes.byref(o) for o in self._outs)
        # Held while a bucket is agreed and its all-reduces are issued: every
        # rank must issue them in one order, which two threads sharing a
        # State cannot keep, so a second concurrent call is refused.
        self._issuing = threading.Lock()

    def __del__(self):
        if getattr(self, "_handle", None):
            LIB.gp_group_free(self._handle)
            self._handle = None

    def _reduce(self, _user, op, code, ptr, n):
        # Called by gradpack during encode, on the hook's thread.
        try:
            if op == 3:  # all-to-all: n words to send, then n that receive
                both = _view(ptr, 2 * n, code)
                dist.all_to_all_single(both[n:], both[:n], group=self._comm)
            elif op == 4:  # all-gather: this rank's chunk lies at its rank
                out = _view(ptr, n, code)
                chunk = n // dist.get_world_size(self._comm)
                mine = out[self._comm_rank * chunk:(self._comm_rank + 1) * chunk].clone()
                dist.all_gather_into_tensor(out, mine, group=self._comm)
            else:
                dist.all_reduce(_view(ptr, n, code), op=_OPS[op], group=self._comm)
            return 0
        except BaseException as e:  # noqa: B902 - handed back to the caller below
            self._failure = e
            return 1

    def _key_of(self, param):
        key = self._param_keys.get(id(param))
        if key is None:
            key = "param%d" % len(self._params)
            self._param_keys[id(param)] = key
            self._params.append(param)
        return key

    def _refuse_input(self, tensor, key, code, why):
        """This rank's part in a standalone bucket it refused (`code`,
        `why`): the exchange every rank runs for it, then the error every
        rank raises, with this rank's own reason after it."""
        name = key.replace("\0", "\\0") if isinstance(key, str) and key else "?"
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) and tensor.dim() <= 32 else (0,)
        try:
            if self._intra is not None:
                # The node's reduce-scatter first, with zeros, as the other local ranks run it.
                _hierarchical(self, torch.zeros(math.prod(shape)), [name], [shape], True, refusal=code)
            else:
                self._refused([name], [shape], code)
        except Error as e:
            raise Error("%s (on this rank: %s)" % (e, why)) from None
        raise Error("gradpack.torch: a refused bucket was not refused (%s)" % why)

    def _refused(self, keys, shapes, code):
        """gp_group_refuse over this State's exchange group: raises the
        error every rank of it raises."""
        self._issue(keys, shapes, lambda ckeys, ndims, cdims: LIB.gp_group_refuse(
            self._handle, len(keys), ckeys, ndims, cdims, code, 0, self._reduce_fn, None))

    def _reduce_now(self, flat, keys, shapes):
        """One standalone bucket encoded, summed and decoded at once, in
        place in `flat` (the mean over ranks; the same error on every
        rank)."""
        self._reduce_held(flat, keys, shapes).commit()

    def _reduce_held(self, flat, keys, shapes, tag=0):
        """`_reduce_now` without the commit: the bucket decoded into `flat`,
        its states held for its `commit()` (or `abandon()`); after an error
        dropped, its states as they were. `tag`: what else every rank must
        hold alike (gp_group_encode's)."""
        pending = self._encode(flat, keys, shapes, True, tag)
        try:
            pending.settle(raising=True)
        except BaseException:
            pending.abandon()
            raise
        return pending

    def _encode(self, flat, keys, shapes, last, tag=0):
        """Agrees and exchanges a bucket; returns it with its final sums in
        flight."""
        def pending():
            handle, words, nwords, floats, nfloats, plain = (o.value for o in self._outs)
            return _Pending(self, handle, flat, keys, words, nwords, floats, nfloats, plain)
        return self._issue(keys, shapes, lambda ckeys, ndims, cdims: LIB.gp_group_encode(
            self._handle, len(keys), ckeys, ndims, cdims, flat.data_ptr(), flat.numel(), int(bool(last)), tag,
            self._reduce_fn, None, *self._out_refs), then=pending)

    def _issue(self, keys, shapes, call, then=None):
        """Runs `call(ckeys, ndims, cdims)`, a C call that hands this
        State's collectives to torch, with the C arrays naming the bucket,
        once the buckets still open on its keys are dropped, and then
        `then()` (the final sums' issue), both under the issuing lock;
        raises torch's error, or gradpack's. Refuses a call while another
        thread is inside one."""
        if not self._issuing.acquire(blocking=False):
            raise Error("gradpack.torch.State used by two threads at once: every rank must issue a State's "
                        "all-reduces in the same order, which concurrent calls cannot keep; use a State from one "
                        "thread at a time (DDP calls its hook from one thread), or one State per thread, each "
                        "with its own process group")
        try:
            if self._open:
                self._settle(keys)
            self._failure = None
            status = call(*self._layout(keys, shapes))
            failure, self._failure = self._failure, None
            if status != 0 and failure is not None:
                raise failure  # torch's own error (a dead rank: its timeout)
            check_call(status)
            return then() if then is not None else None
        finally:
            self._issuing.release()

    def _layout(self, keys, shapes):
        """The C arrays naming a bucket's tensors, made once per layout."""
        def arrays():
            n = len(keys)
            dims = [d for s in shapes for d in s]
            return ((ctypes.c_char_p * n)(*[_c_text(k, "key") for k in keys]), (_u64 * n)(*[len(s) for s in shapes]),
                    (_u64 * max(1, len(dims)))(*dims))
        return _memo(self._layouts, (tuple(keys), tuple(shapes)), arrays)

    def _settle(self, keys=None):
        """Drops the buckets still open (all of them, or those holding one
        of `keys`), once their sums have arrived, leaving their states as
        they were: their step never finished (DDP raised before its last
        bucket, or the caller stopped). Future callbacks remove entries
        meanwhile: `_open` is read from a copy."""
        if keys is None:
            self._abandon_all()  # (every open bucket is listed there)
            return
        opened = self._open.copy()
        for pending in {opened[k] for k in keys if k in opened}:
            pending.abandon()

    def _abandon_all(self):
        """Drops every bucket of the step, after its error: no state changes."""
        for p in list(self._pending):
            p.abandon()
        self._pending.clear()

    def _finish_step(self):
        """Finishes every bucket of the step, in the order they were
        encoded: once every one decoded, commits them all; else drops them
        all (no state changes) and raises the first one's error (every
        rank's first failed bucket is the same one, so every rank raises
        the same error)."""
        pending = list(self._pending)
        first = None
        for p in pending:
            try:
                p.settle(raising=True)
            except Exception as e:  # noqa: BLE001 - raised below, the first one
                first = first or e
        if first is not None:
            self._abandon_all()
            raise first
        for p in pending:
            p.commit()
        self._pending.clear()

    def stats(self):
        """Bytes this rank handed torch.distributed (and what float32
        all-reduces of the same tensors would have), steps, compressed steps,
        and the blocking agreement rounds run (the first bucket, a bucket
        not seen before after the previous one, a failure)."""
        out = (_u64 * 6)()
        check_call(LIB.gp_group_stats(self._handle, out))
        return {"bytes_sent": out[0], "bytes_uncompressed": out[1], "steps": out[2],
                "compressed_steps": out[3], "agreements": out[4], "exchange": "scatter" if self._scatter else "owners" if out[5] else "lanes",
                "hierarchical": self.local_size > 1, "local_size": self.local_size,
                "bytes_within_node": self._intra_bytes}

    def state_dict(self):
        """Every tensor's compression state (residuals, PowerSGD's Q, push
        counts): save each rank's own, between steps."""
        self._settle()
        data, n = ctypes.POINTER(ctypes.c_uint8)(), _u64()
        check_call(LIB.gp_group_save(self._handle, ctypes.byref(data), ctypes.byref(n)))
        try:
            blob = ctypes.string_at(data, n.value)
        finally:
            LIB.gp_buffer_free(data, n)
        # The blob names its compression, rank and world size; load_state_dict checks them there.
        return {"format": _STATE_FORMAT, "states": blob, "local_size": self.local_size, "world_size": self.world_size,
                "rank": self.rank}

    def load_state_dict(self, state_dict):
        """Resumes from ``state_dict()``: another compression, rank, world
        size or shape is an error naming it, and changes nothing."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _STATE_FORMAT:
            raise Error("not a gradpack.torch state_dict (format %r)" % (
                state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__,))
        blob = state_dict.get("states")
        if not isinstance(blob, (bytes, bytearray)):
            raise Error("gradpack.torch state_dict: 'states' must be bytes")
        saved = (state_dict.get("local_size", 1), state_dict.get("world_size", self.world_size))
        if saved != (self.local_size, self.world_size) and max(saved[0], self.local_size) > 1:
            # (Two flat layouts: the blob itself names the world that differs.)
            raise Error("this state_dict was saved by %s; this State runs %s: its states (one per row block of a "
                        "parameter under the hierarchical exchange, one per parameter under the flat one) do not carry over"
                        % (_layout_text(*saved), _layout_text(self.local_size, self.world_size)))
        saved_rank = state_dict.get("rank", self.rank)
        if self.local_size > 1 and saved_rank != self.rank:
            # (The blob names the node, which two local ranks share: the rank is checked here.)
            raise Error("this state_dict was saved by rank %s; this is rank %d: under the hierarchical exchange each "
                        "rank holds the states of its own row blocks, so each rank loads its own"
                        % (saved_rank, self.rank))
        self._settle()
        check_call(LIB.gp_group_load(self._handle, bytes(blob), len(blob)))


def _as_float32(t):
    return t if t.dtype == torch.float32 else t.float()


def _layout_text(local_size, world):
    if local_size > 1:
        return "the hierarchical exchange over %d nodes of %d ranks" % (world // local_size, local_size)
    return "the flat exchange over %d ranks" % world


def _state_args(compress_params, start_iter, min_compression_rate, exchange, fsdp, rank, world):
    """`State`'s arguments as the C ABI takes them, checked (a trial group
    over the flat world refuses what gp_group_new would)."""
    if exchange == "scatter" and not fsdp:
        raise Error("exchange='scatter' is gradpack.torch.fsdp's reduce-scatter (each rank decodes only its own "
                    "rows); DDP's hook and allreduce_ take 'lanes', 'owners' or 'auto'")
    if not isinstance(compress_params, dict):
        raise Error("compress_params must be a dict, got %s" % type(compress_params).__name__)
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or not 0 <= start_iter <= _U64_MAX:
        raise Error("start_iter must be a whole number from 0 to 2**64 - 1, got %r" % (start_iter,))
    keys = [_c_text(k, "compress_params key") for k in compress_params]
    vals = [_c_text(v, "compress_params value") for v in compress_params.values()]
    try:
        rate = float(min_compression_rate)
    except (TypeError, ValueError, OverflowError):
        raise Error("min_compression_rate must be a finite number >= 0, got %r" % (min_compression_rate,)) from None
    args = (keys, vals, start_iter, rate, _c_text(exchange, "exchange"))
    LIB.gp_group_free(_new_group(args, rank, world))
    return args


def _new_group(args, rank, world):
    keys, vals, start_iter, rate, exchange = args
    handle = _p()
    check_call(LIB.gp_group_new((ctypes.c_char_p * len(keys))(*keys), (ctypes.c_char_p * len(vals))(*vals),
                                len(keys), rank, world, start_iter, rate, exchange, ctypes.byref(handle)))
    return handle.value


def _local_size(asked, process_group, rank, world, problem=None):
    """The ranks a node (1: the flat exchange), checked with every rank: an
    error names why the hierarchical exchange cannot run (or `problem`,
    this rank's refusal of another argument), on every rank."""
    import os
    auto = asked is None
    if auto:
        try:
            asked = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        except ValueError:
            asked = 1
        if process_group is not None or not 1 < asked < world:
            asked = 1
    why = problem
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        why = why or "local_size must be a whole number of ranks a node (1 or more), got %r" % (asked,)
        asked = 1
    if asked > 1 and why is None:
        if process_group is not None:
            why = "the hierarchical exchange (local_size=%d) needs the default process group" % asked
        elif world % asked:
            why = "local_size %d does not divide the world of %d ranks" % (asked, world)
        elif auto and os.environ.get("LOCAL_RANK", str(rank % asked)) != str(rank % asked):
            why = ("rank %d has LOCAL_RANK %s, not %d: the hierarchical exchange needs ranks numbered node by node "
                   "(rank = node * local_size + local rank), as torchrun numbers them; pass local_size=1 for the "
                   "flat exchange" % (rank, os.environ["LOCAL_RANK"], rank % asked))
    # Every rank learns every rank's choice and refusal: the same error everywhere.
    told = _gather_texts("%d %s" % (asked, why or ""), process_group, world)
    texts = [t.split(" ", 1)[1] for t in told]
    refused = [(j, t) for j, t in enumerate(texts) if t]
    if refused:
        j, text = refused[0]
        raise Error(text if len(refused) == world and len(set(texts)) == 1 else "rank %d: %s" % (j, text))
    chosen = [int(t.split(" ", 1)[0]) for t in told]
    if len(set(chosen)) > 1:
        other = next(i for i, c in enumerate(chosen) if c != chosen[0])
        raise Error("the ranks chose different local_size values: rank 0 chose %d, rank %d chose %d"
                    % (chosen[0], other, chosen[other]))
    return asked if asked < world else 1


def _slices(shapes, size):
    """Each tensor cut into `size` row blocks (a 1-d tensor into runs), the
    last padded with zeros: (block shapes, block lengths, tensor lengths)."""
    blocks, lengths, totals = [], [], []
    for shape in shapes:
        shape = tuple(shape) or (1,)
        rows, rest = -(-shape[0] // size), 1
        for d in shape[1:]:
            rest *= d
        blocks.append((rows,) + shape[1:])
        lengths.append(rows * rest)
        totals.append(shape[0] * rest)
    return blocks, lengths, totals


def _memo(cache, key, make):
    """`cache[key]`, made by `make()` the first time; a cache past 4,096
    entries starts again (layouts are few, but keys may come from users)."""
    value = cache.get(key)
    if value is None:
        if len(cache) > 4096:
            cache.clear()
        value = cache[key] = make()
    return value


def _timeout_of(group):
    """The timeout `group` was made with (init_process_group's), or None
    (torch's default) where its backend does not say."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def _node_verdict(state, keys, shapes, refusal):
    """The refusal every local rank of the node takes its part as, or None:
    one small MAX all-reduce inside the node, before its reduce-scatter
    (whose sizes come from each rank's own bucket), of a digest of the
    bucket and the State's settings and of any local rank's refusal. A
    rank's refusal wins (its code); else ranks whose digests differ refuse
    as a node that disagrees."""
    layout = (tuple(keys), tuple(tuple(s) for s in shapes))
    digest = _memo(state._digests, layout, lambda: int.from_bytes(
        hashlib.blake2b(repr((state._node_settings, layout)).encode(), digest_size=7).digest(), "little"))
    local = state.rank % state.local_size
    mine = (refusal << 32 | local + 1) if refusal is not None else 0
    told = torch.tensor([digest, -digest, mine], dtype=torch.int64)
    dist.all_reduce(told, op=dist.ReduceOp.MAX, group=state._intra)
    state._intra_bytes += 8 * told.numel()
    if told[2] > 0:
        return int(told[2]) >> 32
    if int(told[0]) != -int(told[1]):
        return _REFUSE_NODE
    return None


def _gather_texts(text, group, size):
    """Every rank's `text` (cut to _TEXT_BYTES - 1 bytes of UTF-8), on every
    rank of `group`, through a uint8 all-gather (torch's object collectives
    can abort a gloo process at exit)."""
    data = text.encode()[:_TEXT_BYTES - 1]
    mine = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    told = torch.empty(size * _TEXT_BYTES, dtype=torch.uint8)
    dist.all_gather_into_tensor(told, mine, group=group)
    return [bytes(told[j * _TEXT_BYTES:(j + 1) * _TEXT_BYTES].tolist()).split(b"\0", 1)[0].decode(errors="replace")
            for j in range(size)]


def _hierarchical(state, flat, keys, shapes, last, refusal=None):
    """One bucket through the hierarchical exchange, in place in `flat`.
    Local rank j owns row block j of every tensor (its key '<key>@j/size'),
    so a tensor's residual stays with it whatever the bucket: a float32
    reduce-scatter inside the node, this rank's blocks (the node's mean)
    compressed across the nodes, an all-gather inside the node. A failure on any rank of the
    node (the same on every node) is raised on every rank with the text of
    the lowest local rank that met it, before any state changes."""
    size = state.local_size
    blocks, lengths, totals = _slices(shapes, size)
    local = state.rank % size
    block_keys = ["%s@%d/%d" % (k, local, size) for k in keys]
    # The node agrees first: a rank whose bucket or settings differ, or
    # that refused its input, makes every local rank refuse across the
    # nodes (no reduce-scatter of sizes that differ).
    refusal = _node_verdict(state, keys, shapes, refusal)
    if refusal is not None:
        failure = "?"
        try:
            state._refused(block_keys, blocks, refusal)  # (raises the error every rank meets)
        except Error as e:
            failure = str(e) or "?"
        told = _gather_texts(failure, state._intra, size)
        state._intra_bytes += _TEXT_BYTES
        _raise_node(state, told)
    parts, at = [], 0
    for length, total in zip(lengths, totals):
        t = flat[at:at + total]
        at += total
        if total < size * length:
            t = torch.cat([t, t.new_zeros(size * length - total)])
        parts.append(t.view(size, length))
    whole = torch.cat(parts, dim=1)  # row j: local rank j's blocks, one after another
    share = flat.new_empty(whole.shape[1])
    dist.reduce_scatter_tensor(share, whole.view(-1), group=state._intra)
    # The node's mean: each node pushes as one worker would (2-bit's and
    # 1-bit's thresholds, start_iter's plain sums keep their meaning).
    share.div_(size)
    pending, failure = None, ""
    try:
        pending = state._encode(share, block_keys, blocks, last)
        for f in pending.futures:
            f.wait()
        pending.check()
    except Error as e:
        failure = str(e) or "?"
    told = _gather_texts(failure, state._intra, size)
    state._intra_bytes += 4 * (whole.numel() + share.numel()) + _TEXT_BYTES
    if any(told):
        if pending is not None:
            pending.abandon()
        _raise_node(state, told)
    pending.decode()  # the nodes' sum of means, divided by the node count (committed with the step)
    dist.all_gather_into_tensor(whole.view(-1), share, group=state._intra)
    at = col = 0
    for length, total in zip(lengths, totals):
        flat[at:at + total].copy_(whole[:, col:col + length].reshape(-1)[:total])
        at += total
        col += length


def _raise_node(state, told):
    """Raises the node's failure: the text of the lowest local rank that
    met one (`told`, every local rank's text or '')."""
    size, nodes = state.local_size, state.world_size // state.local_size
    j, text = next((j, t) for j, t in enumerate(told) if t)
    raise Error("%s (the hierarchical exchange across %d nodes of %d ranks: a rank named above is a node, "
                "node i being ranks i*%d to i*%d+%d; met by local rank %d)"
                % (text, nodes, size, size, size, size - 1, j))


def hook(state, bucket):
    """DDP communication hook: ``ddp.register_comm_hook(state, hook)``.

    A bucket's final sums run asynchronously and are decoded in its
    future's callback, except the step's last bucket: its hook waits for
    every bucket of the step and raises the first one's error, if any, as a
    ``gradpack.Error`` (the same on every rank), where DDP would wait for
    them next anyway."""
    buf = bucket.buffer()
    _check_tensor(buf, "the DDP bucket")
    params = bucket.parameters()
    keys = [state._key_of(p) for p in params]
    shapes = [tuple(p.shape) for p in params]
    flat = _as_float32(buf)  # float16/bfloat16 widened exactly
    try:
        if state._intra is not None:
            _hierarchical(state, flat, keys, shapes, bucket.is_last())
            if bucket.is_last():
                state._finish_step()
        else:
            pending = state._encode(flat, keys, shapes, bucket.is_last())
            if not bucket.is_last():
                def decode(fut):
                    fut.wait()  # raises torch's error when a sum failed
                    for f in fut.value():
                        f.wait()
                    pending.decode()  # the result; its states advance with the step's last bucket
                    if flat is not buf:
                        buf.copy_(flat)
                    return buf

                return torch.futures.collect_all(pending.futures).then(decode)
            state._finish_step()
    except BaseException:
        # The step ends here on every rank (the same error): none of its
        # buckets changes a state.
        state._abandon_all()
        raise
    if flat is not buf:
        buf.copy_(flat)
    done = torch.futures.Future()
    done.set_result(buf)
    return done


def allreduce_(tensor, state, key):
    """Replaces ``tensor`` (on every rank) with its compressed sum over
    ranks divided by the world size, as the hook does for a parameter;
    ``key`` names its state. Returns ``tensor``. A tensor or key refused on
    one rank (its dtype, device, a NUL in the key, an expanded view) is
    the same `gradpack.Error` on every rank: that rank still takes its part
    in the exchange, so no other rank waits for it."""
    refusal = _refusal_of(tensor, key)
    if refusal is not None:
        state._refuse_input(tensor, key, *refusal)
    data = tensor.detach()
    flat = data.reshape(-1) if data.is_contiguous() and data.dtype == torch.float32 else \
        _as_float32(data).contiguous().reshape(-1)
    if state._intra is not None:
        try:
            _hierarchical(state, flat, [key], [tuple(tensor.shape)], True)
            state._finish_step()
        except BaseException:
            state._abandon_all()
            raise
    else:
        state._reduce_now(flat, [key], [tuple(tensor.shape)])
    if flat.data_ptr() != data.data_ptr():
        data.copy_(flat.view(data.shape))
    return tensor


# Why a front refuses a rank's input (gp_group_refuse's codes).
_REFUSE_DTYPE, _REFUSE_DEVICE, _REFUSE_OVERLAP, _REFUSE_KEY, _REFUSE_SIZES, _REFUSE_NODE = 1, 2, 3, 4, 5, 6


def _refusal_of(tensor, key):
    """(code, this rank's text) when `allreduce_` cannot take `tensor`
    under `key`, else None: checked before any exchange, so that the rank
    refuses in the exchange instead of leaving it."""
    try:
        _check_tensor(tensor, "tensor")
    except Error as e:
        return (_REFUSE_DEVICE if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu"
                else _REFUSE_DTYPE), str(e)
    if not isinstance(key, str) or not key:
        return _REFUSE_KEY, "key must be a non-empty str, got %r" % (key,)
    if "\0" in key:
        return _REFUSE_KEY, ("key %r holds a NUL character (at index %d): it would name the state of %r"
                             % (key, key.index("\0"), key[:key.index("\0")]))
    if tensor.dim() > 32:
        return _REFUSE_SIZES, "tensor has %d dimensions (at most 32)" % tensor.dim()
    if any(st == 0 and n > 1 for n, st in zip(tensor.shape, tensor.stride())):
        return _REFUSE_OVERLAP, ("tensor of shape %s and strides %s: its elements share memory (an expanded view), "
                                 "so it cannot hold the result; pass a copy (.contiguous())"
                                 % (tuple(tensor.shape), tensor.stride()))
    return None
