"""gradpack.torch.fsdp: gradpack's schemes in FSDP2's reduce-scatter.

    from torch.distributed.fsdp import fully_shard
    import gradpack.torch.fsdp as gpf
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = gpf.compress(model, {'compress': 'qsgd_mn', 'bits': 2, 'seed': 1})

`compress` sets a custom reduce-scatter on every FSDP module of the model
(FSDP2 takes one per module: the root's covers only the root's own
parameters). Each FSDP unit's reduce-scatter becomes one bucket of the
flat exchange of `gradpack.torch` over FSDP's shard group: every
parameter's whole gradient, keyed by its name in the model, through the
same scheme path as the DDP hook, then this rank's shard of the result.
So each rank's shard is, bit for bit, the matching rows of what
`gradpack.torch.allreduce_` gives for that parameter under that key, and
errors (a NaN on any rank, ranks that differ) are the same
`gradpack.Error` on every rank with every residual unchanged.

This version sums every rank's codes in one all-reduce of lanes and keeps
this rank's rows (the bytes of the DDP hook for the same parameters);
parameters sharded on dim 0 (FSDP's default), one mesh dimension.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..base import Error
from . import State, _as_float32, _check_tensor

__all__ = ["compress", "FSDPState"]

_FORMAT = "gradpack.torch.fsdp/1"


class FSDPState:
    """gradpack's state for a model under `fully_shard` (from `compress`):
    ``stats()``, ``state_dict()`` and ``load_state_dict()`` as
    `gradpack.torch.State` has them (a `torch.distributed.checkpoint`
    Stateful: save each rank's own)."""

    def __init__(self, state, exchange):
        self._state, self._exchange = state, exchange

    def stats(self):
        """As `gradpack.torch.State.stats()`; 'steps' counts reduce-scatters
        (one per FSDP unit per backward); 'exchange' is 'scatter', or 'fsdp'
        under compress 'none' (FSDP2's own reduce-scatter, nothing counted)."""
        return dict(self._state.stats(), exchange=self._exchange)

    def state_dict(self):
        """This rank's states under its own key (``'ranks': {'<rank>': ...}``),
        so that `torch.distributed.checkpoint`, which keeps one copy of each
        key it sees on several ranks, keeps every rank's."""
        return {"format": _FORMAT, "world_size": self._state.world_size,
                "ranks": {str(self._state.rank): self._state.state_dict()}}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise Error("not a gradpack.torch.fsdp state_dict (format %r)" % (
                state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__,))
        ranks = state_dict.get("ranks")
        mine = ranks.get(str(self._state.rank)) if isinstance(ranks, dict) else None
        if mine is None:
            raise Error("this gradpack.torch.fsdp state_dict holds the states of ranks %s, not of rank %d" % (
                sorted(ranks, key=str) if isinstance(ranks, dict) else [], self._state.rank))
        self._state.load_state_dict(mine)


class _ReduceScatter(ReduceScatter):
    """One FSDP unit's reduce-scatter through gradpack (FSDP2's `Comm`)."""

    def __init__(self, state, fsdp_params, names):
        self._state, self._params, self._names = state, fsdp_params, names
        self._flat = None

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def _layout(self, world):
        """Each parameter's key, shape and rows a rank (FSDP pads dim 0 to a
        multiple of the world)."""
        keys, shapes, rows = [], [], []
        for fp in self._params:
            if fp.fsdp_placement.dim != 0:
                raise Error("gradpack.torch.fsdp shards parameters on dim 0 only; %s is %s"
                            % (fp._param_fqn, fp.fsdp_placement))
            shape = tuple(fp._orig_size)
            if not shape:
                raise Error("gradpack.torch.fsdp: a 0-d parameter (%s) cannot be sharded on dim 0" % fp._param_fqn)
            key = fp._param_fqn or self._names.get(id(fp.sharded_param))
            if not key:
                raise Error("gradpack.torch.fsdp: a parameter of shape %s has no name in the model" % (shape,))
            keys.append(key)
            shapes.append(shape)
            rows.append(-(-shape[0] // world))
        return keys, shapes, rows

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        state = self._state
        world, rank = group.size(), group.rank()
        if (world, rank) != (state.world_size, state.rank):
            raise Error("gradpack.torch.fsdp: FSDP reduce-scatters over %d ranks (this one %d), gradpack's state "
                        "over %d (%d): one mesh dimension only" % (world, rank, state.world_size, state.rank))
        _check_tensor(input_tensor, "FSDP's reduce-scatter input")
        keys, shapes, rows = self._layout(world)
        widths = [r * _numel(s[1:]) for r, s in zip(rows, shapes)]
        if input_tensor.numel() != world * sum(widths) or output_tensor.numel() != sum(widths):
            raise Error("gradpack.torch.fsdp: FSDP's reduce-scatter of %d values into %d does not hold parameters %s "
                        "over %d ranks" % (input_tensor.numel(), output_tensor.numel(), shapes, world))
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise Error("gradpack.torch.fsdp: FSDP asked for reduce op %s; gradpack gives AVG and SUM" % (op,))
        by_rank = _as_float32(input_tensor).view(world, -1)
        # Every parameter's whole gradient: its rows from every rank's chunk,
        # FSDP's padding cut, copied once into a buffer kept between steps
        # (a fresh one would fault its pages in again each time).
        total = sum(_numel(s) for s in shapes)
        if self._flat is None or self._flat.numel() != total:
            self._flat = torch.empty(total, dtype=torch.float32)
        flat, at, col = self._flat, 0, 0
        for shape, r, width in zip(shapes, rows, widths):
            per_row = width // r
            for j in range(world):
                valid = max(0, min(r, shape[0] - j * r)) * per_row
                flat[at + j * r * per_row:at + j * r * per_row + valid].copy_(by_rank[j, col:col + valid])
            at += _numel(shape)
            col += width
        pending = state._encode(flat, keys, shapes, True)
        try:
            for f in pending.futures:
                f.wait()
            pending.decode()  # the mean over ranks; the same error on every rank
        finally:
            if pending in state._pending:
                state._pending.remove(pending)
        # This rank's rows of each parameter (world times them under SUM), zeros where FSDP padded.
        out = output_tensor.view(-1)
        at = col = 0
        for shape, r, width in zip(shapes, rows, widths):
            rest = width // r
            mine = flat[at:at + _numel(shape)].view(shape[0], rest)[rank * r:(rank + 1) * r].reshape(-1)
            if op == dist.ReduceOp.SUM:
                mine = mine * world
            out[col:col + mine.numel()].copy_(mine)
            out[col + mine.numel():col + width].zero_()
            at += _numel(shape)
            col += width
        return None


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def compress(model, compress_params, *, start_iter=0, min_compression_rate=2.0):
    """Installs gradpack in the reduce-scatter of every FSDP module of
    `model` (after `fully_shard`); returns its `FSDPState`."""
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
        raise Error("gradpack.torch.fsdp.compress: FSDP meshes of %s dimensions; this version compresses "
                    "1-d fully_shard (not HSDP)" % sorted(mesh))
    pg = groups[0][1].mesh_info.mesh.get_group()
    state = State(compress_params, process_group=pg, start_iter=start_iter,
                  min_compression_rate=min_compression_rate, local_size=1, exchange="scatter", _fsdp=True)
    if compress_params.get("compress") == "none":
        return FSDPState(state, "fsdp")  # FSDP2's own reduce-scatter, untouched
    names = {id(p): n for n, p in model.named_parameters()}
    for m, g in groups:
        m.set_custom_reduce_scatter(_ReduceScatter(state, g.fsdp_params, names))
    return FSDPState(state, "scatter")
