"""gradpack in FSDP2's reduce-scatter beside FSDP2's own, on 2 gloo ranks,
in one run (a program that prints figures, not a test):

  .venv/bin/python benches/torch_fsdp.py                      # loopback
  .venv/bin/python benches/torch_fsdp.py --netns 1gbit 10gbit # as root: the ranks on two
        network namespaces joined by a veth pair limited with tc (tbf)

The model is the 12.6M-parameter MLP of benches/torch_hooks.py (3 layers
of 2048 x 2048, batch 8 of random data) under fully_shard (a unit per
layer, then the root), plain SGD; ms per step over 10 steps after 3 of
warm-up, every variant side by side step by step (each variant's step i
right after the previous one's), so the machine's drift falls on each
alike. Bytes a step are counted by wrapping the calls FSDP2 and gradpack
hand their tensors to: all_gather_single (FSDP's parameters),
reduce_scatter_single, all_to_all_single and all_reduce (the gradients).

With --hsdp: 4 ranks as 2 replicas of 2 shards (under --netns the 2
shards of a replica share a namespace and its loopback; the replicas talk
across the shaped link). Rows: FSDP2's
native HSDP (a 2-d mesh, float32 all-reduce across replicas), the same
with reduce_dtype=bfloat16, 'bound' (each module sharded over the shard
dimension and no all-reduce across replicas at all: wrong training, the
time of the rest of the step), and gradpack's schemes across the replicas
(gradpack.torch.fsdp.compress(..., replicate_group=), the reduce-scatter
inside a replica FSDP2's own). Bytes are split into all-gather,
reduce-scatter and the all-reduce across replicas.

Rows: FSDP2's default (float32 reduce-scatter); MixedPrecisionPolicy with
reduce_dtype=bfloat16; 'bound': a reduce-scatter that sends nothing (each
rank keeps its own gradient's shard; wrong training, the time of every
other part of the step: what no compression of the gradients can beat,
since FSDP2 still all-gathers the parameters uncompressed); and gradpack's
schemes through gradpack.torch.fsdp.compress.
"""
import argparse
import json
import time

import veth

NS = ("gp_fsdp_a", "gp_fsdp_b")
ADDR = ("10.48.0.1", "10.48.0.2")
DEVICES = ("gpfveth_a", "gpfveth_b")

# (label, kind, spec): 'fsdp' FSDP2's own ('float32', 'bf16', 'bound'), 'gradpack' compress_params.
ROWS = [
    ("FSDP2 default (float32)", "fsdp", "float32"),
    ("FSDP2 reduce_dtype=bf16", "fsdp", "bf16"),
    ("bound (no reduce-scatter)", "fsdp", "bound"),
    ("gradpack none", "gradpack", {"compress": "none"}),
    ("gradpack qsgd_mn 2", "gradpack", {"compress": "qsgd_mn", "bits": 2}),
    ("gradpack qsgd_mn_ts [2,6]", "gradpack", {"compress": "qsgd_mn_ts", "bits": [2, 6]}),
    ("gradpack grandk_mn 8 k=n/4", "gradpack", {"compress": "grandk_mn", "bits": 8, "k": 2048 * 2048 // 4}),
    ("gradpack 2bit 0.1", "gradpack", {"compress": "2bit", "threshold": 0.1}),
    ("gradpack 1bit", "gradpack", {"compress": "1bit"}),
    ("gradpack powersgd r=1", "gradpack", {"compress": "powersgd", "rank": 1}),
]


def rank_main(args):
    from datetime import timedelta
    from torch.distributed.device_mesh import init_device_mesh

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    import gradpack.torch.fsdp as gpf

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = {"ag": 0, "rs": 0, "ar": 0}
    across = "ar" if args.hsdp else "rs"  # what an all_reduce carries
    # (name, what it carries, the position and keyword of the tensor handed over)
    wrapped = [("all_gather_single", "ag", 1, "input_tensor"), ("reduce_scatter_single", "rs", 1, "input"),
               ("all_to_all_single", "rs", 1, "input"), ("all_reduce", across, 0, "tensor")]
    real = {name: getattr(dist, name) for name, _, _, _ in wrapped}

    def counting(name, kind, at, key):
        def call(*a, **kw):
            t = a[at] if len(a) > at else kw[key]
            counts[kind] += t.numel() * t.element_size()
            return real[name](*a, **kw)
        return call

    for name, kind, at, key in wrapped:
        setattr(dist, name, counting(name, kind, at, key))

    class NoReduceScatter(ReduceScatter):
        """Sends nothing: each rank keeps its own gradient's shard."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()].view_as(output_tensor))
            return None

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if args.hsdp else None

    def start(label, kind, spec):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                    torch.nn.ReLU(), torch.nn.Linear(2048, 2048))
        kw = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)} if spec == "bf16" else {}
        if mesh is not None:
            # native HSDP: the 2-d mesh; gradpack and the bound: the shard dimension
            kw["mesh"] = mesh if kind == "fsdp" and spec != "bound" else mesh["shard"]
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, **kw)
        fully_shard(model, **kw)
        state = None
        if kind == "gradpack" and mesh is not None:
            state = gpf.compress(model, dict(spec), replicate_group=mesh["replicate"].get_group())
        elif kind == "gradpack":
            state = gpf.compress(model, dict(spec))
        elif spec == "bound" and mesh is not None:
            pass  # sharded over the shard dimension alone: no all-reduce across replicas
        elif spec == "bound":
            for m in model.modules():
                if hasattr(m, "set_custom_reduce_scatter"):
                    m.set_custom_reduce_scatter(NoReduceScatter())
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(8, 2048, generator=g), torch.randn(8, 2048, generator=g)) for _ in range(13)]
        return {"label": label, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=1e-3), "state": state,
                "batches": batches, "elapsed": 0.0, "counted": 0, "ag": 0, "rs": 0, "ar": 0}

    rows = [(label.replace("no reduce-scatter", "no all-reduce across replicas") if args.hsdp else label, kind, spec)
            for label, kind, spec in ROWS]
    runs = [start(*r) for r in rows if not args.only or any(o in r[0] for o in args.only)]
    dist.barrier()
    for i in range(13):
        for r in runs:
            x, y = r["batches"][i]
            counts["ag"] = counts["rs"] = counts["ar"] = 0
            begin = time.perf_counter()
            r["opt"].zero_grad()
            torch.nn.functional.mse_loss(r["model"](x), y).backward()
            r["opt"].step()
            if i >= 3:
                r["elapsed"] += time.perf_counter() - begin
                r["counted"] += 1
                r["ag"] += counts["ag"]
                r["rs"] += counts["rs"]
                r["ar"] += counts["ar"]
    rows = [{"row": r["label"], "ms_per_step": 1000 * r["elapsed"] / r["counted"],
             "all_gather_bytes": r["ag"] / r["counted"], "reduce_scatter_bytes": r["rs"] / r["counted"],
             "replica_bytes": r["ar"] / r["counted"]}
            for r in runs]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def run(link, only, hsdp=False, timeout=3600):
    """2 ranks, or (hsdp) 4 as 2 nodes of 2 (in the namespaces when `link`
    is a rate: a node's ranks share its namespace); rank 0's figures."""
    argv = sum((["--only", o] for o in only), []) + (["--hsdp"] if hsdp else [])
    return veth.run_nodes(__file__, argv, link, 2 if hsdp else 1, NS, DEVICES, ADDR, timeout)


def table(link, rows, hsdp=False):
    base = next((r for r in rows if r["row"].startswith("FSDP2 default")), None)
    bound = next((r for r in rows if r["row"].startswith("bound")), None)
    ranks = "4 ranks as 2 replicas x 2 shards (HSDP)" if hsdp else "2 ranks"
    print("\n12.6M MLP under fully_shard, %s, %s" % (ranks, link or "loopback"))
    print("| row | ms per step | vs default | vs bound | all-gather bytes | reduce-scatter bytes |%s" % (
        " bytes across replicas |" if hsdp else ""))
    print("|---|---|---|---|---|---|%s" % ("---|" if hsdp else ""))
    for r in rows:
        vs = "%.2fx" % (base["ms_per_step"] / r["ms_per_step"]) if base else "-"
        vb = "%.2fx" % (r["ms_per_step"] / bound["ms_per_step"]) if bound else "-"
        print("| %s | %.1f | %s | %s | %d | %d |%s" % (r["row"], r["ms_per_step"], vs, vb, r["all_gather_bytes"],
                                                  r["reduce_scatter_bytes"],
                                                  " %d |" % r["replica_bytes"] if hsdp else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--only", action="append", default=[], help="rows whose labels contain this (repeatable)")
    ap.add_argument("--netns", nargs="*", help="link rates for tc, e.g. 1gbit 10gbit (root)")
    ap.add_argument("--hsdp", action="store_true", help="4 ranks as 2 replicas (the nodes) of 2 shards")
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    try:
        for link in (args.netns or [None]):
            if link:
                veth.up(NS, DEVICES, ADDR, link, burst="4mb")
            rows, failure = run(link, args.only, args.hsdp)
            if rows is None:
                print("\n%s: the job failed:\n%s" % (link or "loopback", failure))
            else:
                table(link, rows, args.hsdp)
    finally:
        if args.netns:
            veth.down(NS)


if __name__ == "__main__":
    main()
