"""All-reduce store benchmark: 2 MPI workers (mpirun, shared memory on this
host) pushpull one 4096 x 4096 float32 key on gradpack's dist_sync_allreduce
store, uncompressed float32 all-reduce beside every compression scheme, all in
this run; prints ms per iteration and bytes each worker hands to MPI.

  .venv/bin/python benches/kvstore_allreduce.py [--workers 2] [--iters 10]"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
N = 4096 * 4096
SCHEMES = [
    ("none (float32 all-reduce)", {}),
    ("2bit ±0.5", {"compress": "2bit", "threshold": 0.5}),
    ("qsgd_mn 2", {"compress": "qsgd_mn", "bits": 2}),
    ("qsgd_mn 8", {"compress": "qsgd_mn", "bits": 8}),
    ("qsgd_mn_ts [2,6]", {"compress": "qsgd_mn_ts", "bits": [2, 6]}),
    ("qsgd_mn_ms [2,4,8]", {"compress": "qsgd_mn_ms", "bits": [2, 4, 8]}),
    ("grandk_mn k=n/16 b=8", {"compress": "grandk_mn", "bits": 8, "k": N // 16}),
    ("grandk_mn_ts k=n/16 [2,6]", {"compress": "grandk_mn_ts", "bits": [2, 6], "k": N // 16}),
    ("powersgd r=4", {"compress": "powersgd", "rank": 4}),
    ("1bit", {"compress": "1bit"}),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    print("%d workers, one 4096 x 4096 key, pushpull; MPI over shared memory on one host" % args.workers)
    print("| scheme | ms per iteration | vs none | bytes to MPI per push | vs none |")
    print("|---|---|---|---|---|")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        for name, params in SCHEMES:
            subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(args.workers), sys.executable,
                            os.path.join(HERE, "allreduce_worker.py"), json.dumps(params), str(args.iters), out],
                           check=True)
            with open(out) as f:
                r = json.load(f)
            base = base or r
            print("| %s | %.1f | %.2fx | %d | 1/%.1f |" % (name, r["ms"], r["ms"] / base["ms"], r["wire"],
                                                         base["wire"] / r["wire"]))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
