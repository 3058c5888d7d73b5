"""gradpack.torch.fsdp: gradpack's schemes in FSDP2's reduce-scatter, and
in HSDP's all-reduce across replicas.

    from torch.distributed.fsdp import fully_shard
    import gradpack.torch.fsdp as gpf
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = gpf.compress(model, {'compress': 'qsgd_mn', 'bits': 2, 'seed': 1})

`compress` sets a custom reduce-scatter on every FSDP module of the model
(FSDP2 takes one per module: the root's covers only the root's own
parameters). Each FSDP unit's reduce-scatter becomes one bucket of a
`gradpack.torch` State over FSDP's shard group whose exchange is the
reduce-scatter (`'scatter'`): every parameter's whole gradient, keyed by
its name in the model, encoded as the DDP hook encodes it; each rank
receives the codes of its own rows from every rank, sums them exactly
and decodes only those. So each rank's shard is, bit for bit, its rows
of what `gradpack.torch.allreduce_` gives for that parameter under that
key, and errors (a NaN on any rank, ranks that differ, input one rank
cannot take) are the same `gradpack.Error` on every rank, raised from
backward() once FSDP2 has finished it, with every residual of that
backward's units unchanged.

HSDP (replicas of a sharded model; the link between replicas is the slow
one in practice): shard each module over the mesh's shard dimension and
pass the replicas' group,

    fully_shard(layer, mesh=mesh['shard']) ...
    state = gpf.compress(model, params, replicate_group=mesh['replicate'].get_group())

and gradpack all-reduces each unit's shard across the replicas (FSDP2's
all-reduce hook), compressed, keyed per row block; the reduce-scatter
inside a replica stays FSDP2's own unless ``compress_shards=True``.
FSDP2's native HSDP (a 2-d mesh) all-reduces across replicas itself,
with no seam to replace it: it is refused, naming this recipe.
"""
import math
import struct

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..base import Error
from . import _REFUSE_DEVICE, _REFUSE_DTYPE, _REFUSE_SIZES, State, _as_float32, _check_tensor

__all__ = ["compress", "FSDPState"]

_FORMAT = "gradpack.torch.fsdp/1"


class FSDPState:
    """gradpack's state for a model under `fully_shard` (from `compress`):
    ``stats()``, ``state_dict()`` and ``load_state_dict()`` as
    `gradpack.torch.State` has them (a `torch.distributed.checkpoint`
    Stateful: each rank saves its own, under its rank)."""

    def __init__(self, scatter, replicas, exchange):
        self._scatter, self._replicas, self._exchange = scatter, replicas, exchange

    def stats(self):
        """As `gradpack.torch.State.stats()`, of the reduce-scatter; 'steps'
        counts reduce-scatters (one per FSDP unit per backward); 'exchange'
        is 'scatter', or 'fsdp' where FSDP2's own reduce-scatter runs
        (compress 'none', or HSDP without compress_shards). Under HSDP,
        'replicas' holds the all-reduce's across replicas."""
        out = dict(self._scatter.stats(), exchange=self._exchange)
        if self._replicas is not None:
            out["replicas"] = self._replicas.stats()
        return out

    def state_dict(self):
        """This rank's states under its global rank (``'ranks': {'<rank>':
        {'scatter': ..., 'replicas': ...}}``), so that
        `torch.distributed.checkpoint`, which keeps one copy of each key it
        sees on several ranks, keeps every rank's."""
        mine = {"scatter": self._scatter.state_dict(),
                "replicas": self._replicas.state_dict() if self._replicas is not None else None}
        return {"format": _FORMAT, "world_size": dist.get_world_size(), "ranks": {str(dist.get_rank()): mine}}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise Error("not a gradpack.torch.fsdp state_dict (format %r)" % (
                state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__,))
        saved_world, world = state_dict.get("world_size"), dist.get_world_size()
        if saved_world != world:
            # (Checked before the ranks' own entries, so every rank raises the same text.)
            raise Error("this gradpack.torch.fsdp state_dict was saved by %s ranks; this job runs %d: each rank's "
                        "states are its own shards' and do not carry over" % (saved_world, world))
        ranks, rank = state_dict.get("ranks"), dist.get_rank()
        mine = ranks.get(str(rank)) if isinstance(ranks, dict) else None
        if not isinstance(mine, dict):
            raise Error("this gradpack.torch.fsdp state_dict holds the states of ranks %s, not of rank %d" % (
                sorted(ranks, key=str) if isinstance(ranks, dict) else [], rank))
        if (mine.get("replicas") is None) != (self._replicas is None):
            raise Error("this gradpack.torch.fsdp state_dict was saved %s replicas (HSDP); this state runs %s" % (
                "without" if mine.get("replicas") is None else "with",
                "with them" if self._replicas is not None else "without them"))
        # Each State's load changes nothing when it refuses; the first is put back when the second does.
        before = self._scatter.state_dict()
        self._scatter.load_state_dict(mine.get("scatter"))
        if self._replicas is not None:
            try:
                self._replicas.load_state_dict(mine["replicas"])
            except Exception:
                self._scatter.load_state_dict(before)
                raise


class _Backward:
    """The units of one backward, finished together at its end (an
    autograd final callback, queued by the first unit): each unit's
    reduce-scatter decodes its shard at once and holds its states; at the
    end they are all committed, or, when any unit failed, all dropped
    (every state as it was) and the first error raised from backward().
    A failure never escapes FSDP's own hooks, so FSDP finishes its
    backward and the next one runs normally; the failed unit's shard
    holds NaN meanwhile. The same on every rank: each unit fails on every
    rank alike."""

    def __init__(self):
        self._held, self._error, self._queued = [], None, False

    def run(self, state, flat, keys, shapes, refusal=None, tag=0):
        """One unit's bucket, in place in `flat`: True when decoded, False
        after a gradpack error (kept for the end of backward). `tag`: what
        else every rank must hold alike (gp_group_encode's)."""
        self._queue()
        try:
            if refusal is not None:
                try:
                    state._refused(keys, shapes, refusal[0])
                except Error as e:
                    raise Error("%s (on this rank: %s)" % (e, refusal[1])) from None
            self._held.append(state._reduce_held(flat, keys, shapes, tag))
            decoded = True
        except Error as e:
            self._error, decoded = self._error or e, False
        if not self._queued:
            self._end()
        return decoded

    def _queue(self):
        if self._queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
            self._queued = True
        except RuntimeError:
            pass  # not inside a backward: each unit finishes on its own

    def _end(self):
        held, error = self._held, self._error
        self._held, self._error, self._queued = [], None, False
        if error is not None:
            for p in held:
                p.abandon()
            raise error
        for p in held:
            p.commit()


class _Unit:
    """What gradpack keeps for one FSDP unit (an FSDP module's parameter
    group): its State, FSDP's parameters, the model's names for them, the
    parameters FSDP packed into this backward's reduce-scatter (those with
    a gradient, grouped by gradient dtype: `_watch`), and a float32 buffer
    kept between steps (a fresh one would fault its pages in again each
    time)."""

    def __init__(self, state, fsdp_params, names, backward):
        self._state, self._params, self._names, self._backward = state, fsdp_params, names, backward
        self._packed = None
        self._flat = None

    def _key(self, fp):
        """A parameter's name in the model: its state's key."""
        key = fp._param_fqn or self._names.get(id(fp.sharded_param))
        if not key:
            raise Error("gradpack.torch.fsdp: a parameter of shape %s has no name in the model"
                        % (tuple(fp._orig_size),))
        return key

    def _layout(self, shards):
        """Each parameter's key, shape and rows a shard: FSDP2's blocks of
        ceil(rows / shards) on dim 0 (the last ones padded, see `_held`)."""
        keys, shapes, rows = [], [], []
        for fp in self._packed if self._packed is not None else self._params:
            if fp.fsdp_placement.dim != 0:
                raise Error("gradpack.torch.fsdp shards parameters on dim 0 only; %s is %s"
                            % (fp._param_fqn, fp.fsdp_placement))
            shape = tuple(fp._orig_size)
            if not shape:
                raise Error("gradpack.torch.fsdp: a 0-d parameter (%s) cannot be sharded on dim 0" % fp._param_fqn)
            keys.append(self._key(fp))
            shapes.append(shape)
            rows.append(-(-shape[0] // shards))
        return keys, shapes, rows

    def _buffer(self, total):
        if self._flat is None or self._flat.numel() != total:
            self._flat = torch.empty(total, dtype=torch.float32)
        return self._flat


class _ReduceScatter(_Unit, ReduceScatter):
    """One FSDP unit's reduce-scatter through gradpack (FSDP2's `Comm`)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        state = self._state
        world, rank = group.size(), group.rank()
        if (world, rank) != (state.world_size, state.rank):
            raise Error("gradpack.torch.fsdp: FSDP reduce-scatters over %d ranks (this one %d), gradpack's state "
                        "over %d (%d): one mesh dimension only" % (world, rank, state.world_size, state.rank))
        keys, shapes, rows = self._layout(world)
        widths = [r * math.prod(s[1:]) for r, s in zip(rows, shapes)]
        # A rank that cannot take its input refuses in the exchange (the
        # others fail alike instead of waiting for it).
        refusal = None
        try:
            _check_tensor(input_tensor, "FSDP's reduce-scatter input")
        except Error as e:
            refusal = (_REFUSE_DEVICE if input_tensor.device.type != "cpu" else _REFUSE_DTYPE, str(e))
        if refusal is None and (input_tensor.numel() != world * sum(widths) or output_tensor.numel() != sum(widths)):
            refusal = (_REFUSE_SIZES, "FSDP's reduce-scatter of %d values into %d does not hold parameters %s over %d "
                       "ranks" % (input_tensor.numel(), output_tensor.numel(), shapes, world))
        if refusal is not None:
            self._backward.run(state, None, keys, shapes, refusal)
            output_tensor.fill_(float("nan"))
            return None
        scale = _scale_of(op, world)
        by_rank = _as_float32(input_tensor).view(world, -1)
        # Every parameter's whole gradient: its rows from every rank's chunk,
        # FSDP's padding cut, copied once into the unit's buffer.
        flat, at, col = self._buffer(sum(math.prod(s) for s in shapes)), 0, 0
        for shape, r, width in zip(shapes, rows, widths):
            per_row = width // r
            for j in range(world):
                valid = _held(shape[0], r, j) * per_row
                flat[at + j * r * per_row:at + j * r * per_row + valid].copy_(by_rank[j, col:col + valid])
            at += math.prod(shape)
            col += width
        # The scale each rank applies to its own rows: every rank must use the same.
        tag = struct.unpack("<Q", struct.pack("<d", scale))[0]
        if not self._backward.run(state, flat, keys, shapes, tag=tag):
            output_tensor.fill_(float("nan"))  # the error is raised at the end of backward
            return None
        # This rank's rows of each parameter (the mean times `scale`), zeros where FSDP padded.
        out = output_tensor.view(-1)
        at = col = 0
        for shape, r, width in zip(shapes, rows, widths):
            rest = width // r
            mine = flat[at:at + math.prod(shape)].view(shape[0], rest)[rank * r:(rank + 1) * r].reshape(-1)
            if scale != 1.0:
                mine = mine * scale
            out[col:col + mine.numel()].copy_(mine)
            out[col + mine.numel():col + width].zero_()
            at += math.prod(shape)
            col += width
        return None


class _ReplicaAllReduce(_Unit):
    """One FSDP unit's all-reduce across replicas (HSDP; FSDP2's all-reduce
    hook, called with this rank's shard after the reduce-scatter): the
    shard's rows of each parameter keyed as row block j of S (this rank's
    shard index j), through a `gradpack.torch` State over the replicas'
    group; the mean over replicas, in place."""

    def __init__(self, state, fsdp_params, names, backward, shard_rank, shards):
        super().__init__(state, fsdp_params, names, backward)
        self._shard, self._shards = shard_rank, shards

    def __call__(self, reduce_output):
        keys, shapes, at = [], [], []
        col = 0
        for key, shape, rows in zip(*self._layout(self._shards)):
            per_row = math.prod(shape[1:])
            valid = _held(shape[0], rows, self._shard)
            if valid:
                keys.append("%s@%d/%d" % (key, self._shard, self._shards))
                shapes.append((valid,) + shape[1:])
                at.append((col, valid * per_row))
            col += rows * per_row
        if not keys:
            return  # no row of this unit here (nor on the other replicas of this shard)
        # A shard this rank cannot take refuses in the exchange (the other
        # replicas fail alike instead of waiting for it).
        refusal = None
        try:
            _check_tensor(reduce_output, "FSDP's reduce-scatter output")
        except Error as e:
            refusal = (_REFUSE_DEVICE if reduce_output.device.type != "cpu" else _REFUSE_DTYPE, str(e))
        if refusal is None and col != reduce_output.numel():
            refusal = (_REFUSE_SIZES, "FSDP's reduce-scatter output of %d values does not hold parameters %s sharded "
                       "%d ways" % (reduce_output.numel(), [tuple(fp._orig_size) for fp in self._params], self._shards))
        if refusal is not None:
            self._backward.run(self._state, None, keys, shapes, refusal)
            reduce_output.fill_(float("nan"))
            return
        flat, out, i = self._buffer(sum(n for _, n in at)), reduce_output.view(-1), 0
        for a, n in at:
            flat[i:i + n].copy_(out[a:a + n])
            i += n
        if not self._backward.run(self._state, flat, keys, shapes):  # the mean over replicas
            reduce_output.fill_(float("nan"))  # the error is raised at the end of backward
            return
        i = 0
        for a, n in at:
            out[a:a + n].copy_(flat[i:i + n])
            i += n


def _held(first, block, j):
    """The rows of `first` that block j of `block` rows holds (FSDP2 pads
    the blocks past the last row)."""
    return max(0, min(block, first - j * block))


def _scale_of(op, world):
    """What the mean over `world` ranks is multiplied by for FSDP's reduce
    op: AVG 1, SUM world, PREMUL_SUM(f) world times f (FSDP2's
    `set_gradient_divide_factor`)."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return 1.0
    if kind == dist.ReduceOp.SUM:
        return float(world)
    if kind == dist.ReduceOp.PREMUL_SUM and isinstance(getattr(op, "factor", None), float):
        return world * op.factor
    raise Error("gradpack.torch.fsdp: FSDP asked for reduce op %s; gradpack gives AVG, SUM and PREMUL_SUM "
                "with a factor" % (op,))


def compress(model, compress_params, *, start_iter=0, min_compression_rate=2.0, replicate_group=None,
             compress_shards=None):
    """Installs gradpack in the reduce-scatter of every FSDP module of
    `model` (after `fully_shard`) and, given the replicas' process group
    (HSDP, each module sharded over the shard dimension of the mesh), in
    their all-reduce across replicas; returns its `FSDPState`.
    ``compress_shards`` (default: True without replicas, False with them)
    says whether the reduce-scatter inside a replica is gradpack's too."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise Error("gradpack.torch.fsdp.compress: %s holds no fully_shard module" % type(model).__name__)
    groups = []
    for m in units:
        fsdp_state = m._get_fsdp_state()
        groups += [(m, g) for g in fsdp_state._fsdp_param_groups]
    if not groups:
        raise Error("gradpack.torch.fsdp.compress: no FSDP module of %s holds parameters" % type(model).__name__)
    mesh = {g.mesh_info.mesh.ndim for _, g in groups}
    if mesh != {1}:
        raise Error("gradpack.torch.fsdp.compress: FSDP meshes of %s dimensions: FSDP2's native HSDP all-reduces "
                    "across replicas itself, with no seam for gradpack; shard over the mesh's shard dimension and "
                    "pass the replicas' group: fully_shard(m, mesh=mesh['shard']) for each module, then "
                    "compress(model, params, replicate_group=mesh['replicate'].get_group())" % sorted(mesh))
    pg = groups[0][1].mesh_info.mesh.get_group()
    if any(g.mesh_info.mesh.get_group() is not pg for _, g in groups):
        raise Error("gradpack.torch.fsdp.compress: the FSDP modules of %s shard over different process groups"
                    % type(model).__name__)
    if compress_shards is None:
        compress_shards = replicate_group is None
    state = State(compress_params, process_group=pg, start_iter=start_iter,
                  min_compression_rate=min_compression_rate, local_size=1, exchange="scatter", _fsdp=True)
    replicas = None
    if replicate_group is not None:
        if not isinstance(replicate_group, dist.ProcessGroup):
            raise Error("gradpack.torch.fsdp.compress: replicate_group must be a torch.distributed ProcessGroup, got "
                        "%s" % type(replicate_group).__name__)
        if dist.get_world_size(replicate_group) * dist.get_world_size(pg) != dist.get_world_size():
            raise Error("gradpack.torch.fsdp.compress: %d replicas of %d shards are not the world of %d ranks" % (
                dist.get_world_size(replicate_group), dist.get_world_size(pg), dist.get_world_size()))
        shared = set(dist.get_process_group_ranks(replicate_group)) & set(dist.get_process_group_ranks(pg))
        if shared != {dist.get_rank()}:
            raise Error("gradpack.torch.fsdp.compress: replicate_group holds ranks %s of this rank's shard group "
                        "(FSDP's mesh); its replicas must each hold this rank's shard in another replica, sharing "
                        "only this rank" % sorted(shared))
        replicas = State(compress_params, process_group=replicate_group, start_iter=start_iter,
                         min_compression_rate=min_compression_rate, local_size=1)
    names = {id(p): n for n, p in model.named_parameters()}
    scatter = compress_shards and compress_params.get("compress") != "none"
    backward = _Backward()
    for m, g in groups:
        units = []
        if scatter:
            units.append(_ReduceScatter(state, g.fsdp_params, names, backward))
            m.set_custom_reduce_scatter(units[-1])
        if replicas is not None:
            units.append(_ReplicaAllReduce(replicas, g.fsdp_params, names, backward, dist.get_rank(pg),
                                           dist.get_world_size(pg)))
            m.set_all_reduce_hook(units[-1])
        _watch(g, units)
    return FSDPState(state, replicas, "scatter" if scatter else "fsdp")


def _watch(param_group, units):
    """Has `units` learn which parameters FSDP packs into each
    reduce-scatter: those with a gradient this backward, grouped by
    gradient dtype (FSDP2's `_take_unsharded_grads_to_reduce`), which the
    reduce-scatter itself is not told. Without that method (another torch)
    every parameter, in order."""
    take = getattr(param_group, "_take_unsharded_grads_to_reduce", None)
    if take is None:
        return

    def taken():
        params, grads = take()
        for u in units:
            u._packed = list(params)
        return params, grads

    param_group._take_unsharded_grads_to_reduce = taken
