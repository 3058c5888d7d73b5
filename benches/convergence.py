"""Convergence of every compression scheme (a program, not a test): the digits
MLP trained by 2 and 4 MPI workers on gradpack's 'dist_sync_allreduce' store
(benches/convergence_worker.py under mpirun), printing final accuracy, bytes
each worker sent per epoch and time per epoch, and plotting accuracy against
epochs into docs/convergence.png (needs matplotlib: pip install 'matplotlib<3.8'
'numpy<1.24', as matplotlib alone pulls a newer numpy, which MXNet 1.9.1 refuses).

Run: python benches/convergence.py [--epochs N] [--workers 2 4] [--only NAME ...] [--hidden H]"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMES = [
    ("none", {}),
    ("2bit ±3", {"compress": "2bit", "threshold": 3.0}),
    ("qsgd_mn 2", {"compress": "qsgd_mn", "bits": 2}),
    ("qsgd_mn 4", {"compress": "qsgd_mn", "bits": 4}),
    ("qsgd_mn 8", {"compress": "qsgd_mn", "bits": 8}),
    ("qsgd_mn_ts [2,6]", {"compress": "qsgd_mn_ts", "bits": [2, 6]}),
    ("qsgd_mn_ms [2,4,8]", {"compress": "qsgd_mn_ms", "bits": [2, 4, 8]}),
    ("grandk_mn k=1024 b=8", {"compress": "grandk_mn", "bits": 8, "k": 1024}),
    ("grandk_mn_ts k=1024 [2,6]", {"compress": "grandk_mn_ts", "bits": [2, 6], "k": 1024}),
    ("powersgd r=1", {"compress": "powersgd", "rank": 1}),
    ("powersgd r=2", {"compress": "powersgd", "rank": 2}),
    ("1bit", {"compress": "1bit", "threshold": 0.0}),
]


def run(workers, params, epochs, hidden, out):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(workers), sys.executable,
           os.path.join(HERE, "convergence_worker.py"), "--params", json.dumps(params),
           "--epochs", str(epochs), "--hidden", str(hidden), "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--hidden", type=int, default=64,
                   help="units of the MLP's hidden layer (2048: a first layer of 131072 weights)")
    p.add_argument("--only", nargs="+", default=[],
                   help="schemes whose names contain one of these (and 'none', the baseline)")
    p.add_argument("--plot", default=os.path.join(HERE, "..", "docs", "convergence.png"))
    args = p.parse_args()
    schemes = [(name, params) for name, params in SCHEMES
               if not args.only or name == "none" or any(o in name for o in args.only)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.workers:
            print("\n%d workers, %d epochs, batch 32 per worker, SGD lr 0.1 momentum 0.9, hidden layer %d"
                  % (w, args.epochs, args.hidden))
            print("| scheme | final accuracy | vs none | KB sent per worker per epoch | vs none | s per epoch |")
            print("|---|---|---|---|---|---|")
            for name, params in schemes:
                r = run(w, params, args.epochs, args.hidden, os.path.join(tmp, "r.json"))
                results[(w, name)] = r
                base = results[(w, "none")]
                kb = r["wire_bytes"] / args.epochs / 1024
                print("| %s | %.2f%% | %+.2f | %.1f | 1/%.1f | %.3f |" % (
                    name, 100 * r["accuracy"][-1], 100 * (r["accuracy"][-1] - base["accuracy"][-1]), kb,
                    base["wire_bytes"] / max(r["wire_bytes"], 1), r["s_per_epoch"]))
                sys.stdout.flush()
    if args.only or args.hidden != 64:
        return  # the plot in the docs is of every scheme on the 64-unit MLP
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, axes = plt.subplots(1, len(args.workers), figsize=(6 * len(args.workers), 4.5), sharey=True)
    axes = axes if len(args.workers) > 1 else [axes]
    for ax, w in zip(axes, args.workers):
        for name, _ in SCHEMES:
            acc = results[(w, name)]["accuracy"]
            ax.plot(range(1, len(acc) + 1), [100 * a for a in acc], label=name,
                    linewidth=2.5 if name == "none" else 1.2, color="black" if name == "none" else None)
        ax.set_title("digits MLP, %d workers (dist_sync_allreduce)" % w)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    axes[-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print("\nplot: %s" % os.path.normpath(args.plot))


if __name__ == "__main__":
    main()
