"""gradpack's DDP hooks beside torch's own, on 2 gloo ranks, in one run
(a program that prints figures, not a test):

  .venv/bin/python benches/torch_hooks.py                # loopback: the digits CNN and the 12.6M model
  .venv/bin/python benches/torch_hooks.py --model digits --repeat 5   # 5 rounds, each
        figure the median round's
  .venv/bin/python benches/torch_hooks.py --netns 1gbit 10gbit   # as root: the ranks on two
        network namespaces joined by a veth pair limited with tc (tbf)

Each hook trains the same model from the same weights on the same shards:
  digits  the CNN of examples/torch_ddp.py, 220 steps of 32 images a rank
          (plain SGD 0.5 a batch; 0.3 for 1bit): ms per step, bytes per
          step handed to torch.distributed, test accuracy;
  big     an MLP of 12.6M parameters (3 layers of 2048 x 2048), batch 8
          of random data: ms per step over 10 steps after 3 of warm-up.
Within a round every hook trains side by side, step by step (each hook's
step i right after the previous hook's step i), so the machine's drift
falls on every hook alike. Bytes are counted by wrapping the calls every
hook here (torch's and gradpack's) hands its tensors to: all_reduce, the
owners exchange's all_to_all_single and all_gather_into_tensor, apart from
the hierarchical exchange's reduce-scatter and all-gather inside a node
(--per-node: 2 nodes of that many ranks, LOCAL_WORLD_SIZE set as torchrun
sets it; the flat rows pass local_size=1; the 'gradpack owners' rows run
every integer scheme flat over the 2N ranks with exchange='owners'). torch's
powerSGD_hook runs with a single bucket (it aborts on gloo with more);
--torch-powersgd-buckets shows that failure.
"""
import argparse
import json
import os
import sys
import time

import veth

HERE = os.path.dirname(os.path.abspath(__file__))
NS = ("gp_torch_a", "gp_torch_b")
ADDR = ("10.47.0.1", "10.47.0.2")
DEVICES = ("gptveth_a", "gptveth_b")

# (label, kind, spec): kind 'torch' names a hook of torch's, 'gradpack' gives compress_params.
HOOKS = [
    ("allreduce_hook", "torch", "allreduce"),
    ("fp16_compress_hook", "torch", "fp16"),
    ("bf16_compress_hook", "torch", "bf16"),
    ("powerSGD_hook r=1 (1 bucket)", "torch", "powersgd1"),
    ("powerSGD_hook r=2 (1 bucket)", "torch", "powersgd2"),
    ("gradpack none", "gradpack", {"compress": "none"}),
    ("gradpack qsgd_mn 2", "gradpack", {"compress": "qsgd_mn", "bits": 2}),
    ("gradpack qsgd_mn_ts [2,6]", "gradpack", {"compress": "qsgd_mn_ts", "bits": [2, 6]}),
    ("gradpack qsgd_mn_ms [2,4,8]", "gradpack", {"compress": "qsgd_mn_ms", "bits": [2, 4, 8]}),
    ("gradpack grandk_mn 8 k=n/4", "gradpack", {"compress": "grandk_mn", "bits": 8, "k": "quarter"}),
    ("gradpack grandk_mn_ts k=n/4", "gradpack", {"compress": "grandk_mn_ts", "bits": [2, 6], "k": "quarter"}),
    ("gradpack 2bit 0.1", "gradpack", {"compress": "2bit", "threshold": 0.1}),
    ("gradpack 1bit", "gradpack", {"compress": "1bit"}),
    ("gradpack powersgd r=1", "gradpack", {"compress": "powersgd", "rank": 1}),
    ("gradpack powersgd r=2", "gradpack", {"compress": "powersgd", "rank": 2}),
]
# With --per-node above 1: every gradpack scheme again through the
# hierarchical exchange (the rows above then run the flat one, local_size=1).
HIERARCHICAL = [("gradpack hier " + label[len("gradpack "):], kind, dict(spec, local_size="node"))
                for label, kind, spec in HOOKS if kind == "gradpack"]
# ...and every integer scheme flat through the owners exchange (exchange='owners').
OWNERS = [("gradpack owners " + label[len("gradpack "):], kind, dict(spec, exchange="owners"))
          for label, kind, spec in HOOKS if kind == "gradpack" and spec["compress"] not in ("none", "powersgd")]


def rank_main(args):
    """One rank: every hook on the asked model; rank 0 writes the figures."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradpack.torch as gpt

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import torch_ddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    sent, inside = [0], [0]
    real_all_reduce = dist.all_reduce
    real_reduce_scatter, real_all_gather = dist.reduce_scatter_tensor, dist.all_gather_into_tensor
    real_all_to_all = dist.all_to_all_single

    def counting_all_reduce(tensor, *a, **kw):
        sent[0] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *a, **kw)

    def counting_reduce_scatter(output, input, *a, **kw):
        inside[0] += input.numel() * input.element_size()
        return real_reduce_scatter(output, input, *a, **kw)

    def counting_all_gather(output, input, *a, **kw):
        # inside a node (the hierarchical exchange's group), or across the
        # world (the owners exchange, on the default group)
        (sent if kw.get("group") is None else inside)[0] += input.numel() * input.element_size()
        return real_all_gather(output, input, *a, **kw)

    def counting_all_to_all(output, input, *a, **kw):
        sent[0] += input.numel() * input.element_size()
        return real_all_to_all(output, input, *a, **kw)

    dist.all_reduce = counting_all_reduce
    dist.reduce_scatter_tensor, dist.all_gather_into_tensor = counting_reduce_scatter, counting_all_gather
    dist.all_to_all_single = counting_all_to_all

    def big_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                   torch.nn.ReLU(), torch.nn.Linear(2048, 2048))

    def register(ddp, kind, spec, n_largest):
        if kind == "gradpack":
            params = dict(spec)
            if params.get("k") == "quarter":
                params["k"] = n_largest // 4
            local = args.per_node if params.pop("local_size", None) == "node" else 1
            state = gpt.State(params, local_size=local, exchange=params.pop("exchange", "lanes"))
            ddp.register_comm_hook(state, gpt.hook)
            return state
        if spec == "allreduce":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif spec == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif spec == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        else:
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(spec[-1]),
                                                start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None

    data = torch_ddp.digits()
    results = {}
    hooks = HOOKS + (HIERARCHICAL + OWNERS if args.per_node > 1 else [])
    chosen = [h for h in hooks if not args.only or any(o in h[0] for o in args.only)]

    def start(label, kind, spec):
        """One hook's training run, ready for its first step."""
        one_bucket = kind == "torch" and spec.startswith("powersgd") and not args.torch_powersgd_buckets
        cap = 4096 if one_bucket else 25
        if args.model == "digits":
            torch.manual_seed(0)
            model = torch_ddp.DigitsCNN()
            xtr, ytr, xte, yte = data
            lr = 0.3 if kind == "gradpack" and spec["compress"] == "1bit" else 0.5
            opt = torch.optim.SGD(model.parameters(), lr=lr / 32)
            mine = torch.arange(rank, len(ytr), world)
            batches = []
            for epoch in range(5 * world):
                order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))]
                batches += [order[i:i + 32] for i in range(0, len(order) - 31, 32)]
            warm = 0
        else:
            model = big_model()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(rank)
            batches = [(torch.randn(8, 2048, generator=g), torch.randn(8, 2048, generator=g)) for _ in range(13)]
            warm = 3
        ddp = DDP(model, bucket_cap_mb=cap)
        register(ddp, kind, spec, max(p.numel() for p in model.parameters()))
        return {"label": label, "model": model, "opt": opt, "ddp": ddp, "batches": batches, "warm": warm,
                "elapsed": 0.0, "counted": 0, "sent": 0, "inside": 0}

    # Each round runs every hook side by side, step by step (hook A's step
    # i, then hook B's step i, ...): the machine's drift, which reaches tens
    # of percent within a minute here, falls on every hook alike. Each
    # figure is the median of its rounds.
    for _ in range(args.repeat):
        runs = [start(*h) for h in chosen]
        dist.barrier()
        for i in range(max(len(r["batches"]) for r in runs)):
            for r in runs:
                if i >= len(r["batches"]):
                    continue
                b, ddp, opt = r["batches"][i], r["ddp"], r["opt"]
                sent[0] = inside[0] = 0
                begin = time.perf_counter()
                opt.zero_grad()
                if args.model == "digits":
                    loss = torch.nn.functional.cross_entropy(ddp(data[0][b]), data[1][b], reduction="sum")
                else:
                    loss = torch.nn.functional.mse_loss(ddp(b[0]), b[1])
                loss.backward()
                opt.step()
                if i >= r["warm"]:
                    r["elapsed"] += time.perf_counter() - begin
                    r["counted"] += 1
                    r["sent"] += sent[0]
                    r["inside"] += inside[0]
        for r in runs:
            accuracy = None
            if args.model == "digits":
                with torch.no_grad():
                    accuracy = (r["model"](data[2]).argmax(1) == data[3]).float().mean().item()
            res = results.setdefault(r["label"], {"hook": r["label"], "ms": []})
            res["ms"].append(1000 * r["elapsed"] / r["counted"])
            res.update(ms_per_step=sorted(res["ms"])[len(res["ms"]) // 2], bytes_per_step=r["sent"] / r["counted"],
                       node_bytes_per_step=r["inside"] / r["counted"], accuracy=accuracy, steps=r["counted"])
        del runs
        import gc
        gc.collect()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(list(results.values()), f)
    dist.barrier()  # every rank done before any tears down (torch 2.15 on gloo can abort otherwise)
    dist.destroy_process_group()


def run(model, link, only, torch_powersgd_buckets=False, repeat=1, per_node=1, timeout=3600):
    """Starts 2 "nodes" of `per_node` ranks each (in the namespaces when
    `link` is a rate: the ranks of a node share its namespace, and reach
    each other over its loopback); rank 0's figures."""
    argv = ["--model", model] + sum((["--only", o] for o in only), [])
    argv += ["--repeat", str(repeat), "--per-node", str(per_node)]
    if torch_powersgd_buckets:
        argv.append("--torch-powersgd-buckets")
    return veth.run_nodes(__file__, argv, link, per_node, NS, DEVICES, ADDR, timeout)


def table(model, link, rows, per_node=1):
    base = next((r for r in rows if r["hook"] == "allreduce_hook"), None)
    rounds = len(rows[0]["ms"]) if rows else 0
    ranks = "2 ranks" if per_node == 1 else "2 nodes x %d ranks" % per_node
    print("\n%s model, %s, %s%s" % (model, ranks, link or "loopback", ", median of %d rounds" % rounds if rounds > 1 else ""))
    node = per_node > 1
    print("| hook | ms per step | vs allreduce_hook | bytes per step |%s accuracy |" % (" bytes inside the node |" if node else ""))
    print("|---|---|---|---|%s---|" % ("---|" if node else ""))
    for r in rows:
        speed = "%.2fx" % (base["ms_per_step"] / r["ms_per_step"]) if base else "-"
        acc = "%.2f%%" % (100 * r["accuracy"]) if r["accuracy"] is not None else "-"
        inside = " %d |" % r["node_bytes_per_step"] if node else ""
        print("| %s | %.1f | %s | %d |%s %s |" % (r["hook"], r["ms_per_step"], speed, r["bytes_per_step"], inside, acc))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=["digits", "big"], action="append")
    ap.add_argument("--only", action="append", default=[], help="hooks whose labels contain this (repeatable)")
    ap.add_argument("--netns", nargs="*", help="link rates for tc, e.g. 1gbit 10gbit (root)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds, one after another (every hook side by side in each); each figure is the median round's")
    ap.add_argument("--per-node", type=int, default=1,
                    help="ranks a node (the 2 nodes: the 2 namespaces under --netns); above 1, every gradpack "
                         "scheme also runs the hierarchical exchange ('gradpack hier' rows)")
    ap.add_argument("--torch-powersgd-buckets", action="store_true",
                    help="run torch's powerSGD_hook with DDP's default buckets (it fails on gloo)")
    args = ap.parse_args()
    if args.rank_main:
        args.model = args.model[0]
        return rank_main(args)
    links = args.netns if args.netns else [None]
    models = args.model or (["big"] if args.netns else ["digits", "big"])
    try:
        for link in links:
            if link:
                veth.up(NS, DEVICES, ADDR, link, burst="4mb")
            for model in models:
                rows, failure = run(model, link, args.only, args.torch_powersgd_buckets, args.repeat, args.per_node)
                if rows is None:
                    print("\n%s model, %s: the job failed:\n%s" % (model, link or "loopback", failure))
                else:
                    table(model, link, rows, args.per_node)
    finally:
        if args.netns:
            veth.down(NS)


if __name__ == "__main__":
    main()
