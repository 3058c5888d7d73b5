"""Every gradpack scheme through the DDP hook (or, with --fsdp, in FSDP2's
reduce-scatter), training the digits CNN of examples/torch_ddp.py, beside
uncompressed training in the same processes:

    torchrun --nproc_per_node 4 benches/torch_convergence.py [--epochs E] [--seeds S] [--check 2.0] [--fsdp]

Plain SGD (no momentum: 2-bit's capped steps and momentum do not mix),
0.5 per batch of 32 (0.3 for 1bit, whose codes are +-1), and 5 epochs per
rank: 220 steps at 2 and 4 ranks (fewer past that, as each
rank's shard drops its partial batch). Prints each scheme's test accuracy, its difference from uncompressed
('none' through the same hook), bytes sent per step and ms per step. With
--seeds S, each scheme trains from S seeds (initial weights, data order,
the scheme's own seed) and the mean of their accuracies is compared. With
--check P, exits 1 when a scheme ends more than P points below
uncompressed (the test command runs it with 3 seeds at 2 and 4 ranks, under
DDP and FSDP2).
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch_ddp  # noqa: E402

# (compress_params, learning rate per batch). The 2-bit threshold is on the
# scale of the summed loss's gradients (mostly 0.01 to 0.3); random-K keeps
# a quarter of the largest layer (32768 weights).
SCHEMES = [
    ({"compress": "none"}, 0.5),
    ({"compress": "2bit", "threshold": 0.1}, 0.5),
    ({"compress": "qsgd_mn", "bits": 2, "seed": 1}, 0.5),
    ({"compress": "qsgd_mn_ts", "bits": [2, 6], "seed": 1}, 0.5),
    ({"compress": "qsgd_mn_ms", "bits": [2, 4, 8], "seed": 1}, 0.5),
    ({"compress": "grandk_mn", "bits": 8, "k": 8192, "seed": 1}, 0.5),
    ({"compress": "grandk_mn_ts", "bits": [2, 6], "k": 8192, "seed": 1}, 0.5),
    ({"compress": "powersgd", "rank": 2, "seed": 1}, 0.5),
    ({"compress": "1bit"}, 0.3),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default: 5 per rank")
    parser.add_argument("--check", type=float, default=None)
    parser.add_argument("--seeds", type=int, default=1,
                        help="trains each scheme from this many seeds (initial weights, data order, the scheme's "
                             "seed) and compares the mean of their accuracies")
    parser.add_argument("--only", default=None, help="schemes whose names contain this, beside 'none'")
    parser.add_argument("--exchange", default="lanes", choices=["auto", "lanes", "owners"],
                        help="State(exchange=) for the integer schemes (PowerSGD and 'none' take lanes)")
    parser.add_argument("--fsdp", action="store_true",
                        help="the model under FSDP2's fully_shard, gradpack in its reduce-scatter (gradpack.torch.fsdp)")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    data = torch_ddp.digits()
    epochs = args.epochs or 5 * dist.get_world_size()
    schemes = [(p, lr) for p, lr in SCHEMES if p["compress"] == "none" or args.only is None or args.only in p["compress"]]
    float_final = ("none", "powersgd")
    rows = [(p, [torch_ddp.train(dict(p, seed=p["seed"] + seed) if "seed" in p else p, epochs=epochs, lr=lr,
                                 momentum=0.0, data=data, min_compression_rate=1.0, seed=seed, fsdp=args.fsdp,
                                 exchange="lanes" if p["compress"] in float_final else args.exchange)
                 for seed in range(args.seeds)])
            for p, lr in schemes]
    failed = []
    if dist.get_rank() == 0:
        mean = [sum(r["accuracy"] for r in runs) / len(runs) for _, runs in rows]
        print("digits CNN, %d ranks, %d epochs, %d steps, %s; %s; bytes and ms per step of rank 0" % (
            dist.get_world_size(), epochs, rows[0][1][0]["steps"],
            "FSDP2 (fully_shard), gradpack in its reduce-scatter" if args.fsdp else "DDP, exchange " + args.exchange,
            "the mean accuracy of %d seeds" % args.seeds if args.seeds > 1 else "seed 0"))
        print("%-40s %9s %8s %12s %9s%s" % ("compress_params", "accuracy", "vs none", "bytes/step", "ms/step",
                                            "  per seed" if args.seeds > 1 else ""))
        for (p, runs), accuracy in zip(rows, mean):
            diff = 100 * (accuracy - mean[0])
            r = runs[0]
            own = r["stats"].get("exchange") == "fsdp"  # FSDP2's own reduce-scatter: nothing of gradpack's to count
            print("%-40s %8.2f%% %+8.2f %12s %9.2f%s" % (
                ", ".join("%s" % v for v in p.values()), 100 * accuracy, diff,
                "FSDP's" if own else r["stats"]["bytes_sent"] // r["steps"], r["ms_per_step"],
                "  " + " ".join("%.2f" % (100 * r["accuracy"]) for r in runs) if args.seeds > 1 else ""))
            if args.check is not None and diff < -args.check:
                failed.append(p["compress"])
        if failed:
            print("more than %.2f points below uncompressed: %s" % (args.check, ", ".join(failed)))
    # A tensor, not broadcast_object_list: torch 2.15's object collectives
    # on gloo can abort the process at exit.
    verdict = torch.tensor([len(failed)])
    dist.broadcast(verdict, src=0)
    dist.barrier()  # every rank done before any tears down (torch 2.15 on gloo can abort otherwise)
    # Even after the barrier, torch 2.15's gloo teardown aborted one of 4
    # ranks (SIGABRT) in 2 of about 14 runs of the test command: the verdict
    # is in, so leave without running C++ destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if verdict.item() else 0)


if __name__ == "__main__":
    main()
