"""What the start-up hook (python/gradpack-startup.pth) costs every Python
process: interpreter start with the hook's line in a site directory beside
the same start without it, alternated run by run.

    python benches/startup_hook.py [--runs 300]

Each run is `python -S -c "import site; site.addsitedir(D)"`, D a new
directory holding a copy of the hook or nothing, so the two differ only by
Python reading and running the hook's line. Prints the medians and their
ratio: first two empty directories (the noise floor), then a process outside a job and for a worker with
GRADPACK_SERVE_ROLES=1 (the line's two environment lookups; neither imports
anything)."""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "gradpack-startup.pth")


def start_time(site_dir, env):
    t = time.perf_counter()
    subprocess.run([sys.executable, "-S", "-c", "import site; site.addsitedir(%r)" % site_dir], env=env, check=True)
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=300)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with_hook, without, empty = (os.path.join(tmp, d) for d in ("with", "without", "empty"))
        for d in (with_hook, without, empty):
            os.mkdir(d)
        shutil.copy(HOOK, with_hook)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "GRADPACK_SERVE"))}
        # The first case compares two empty directories: the noise floor.
        cases = [("noise: no hook against no hook", base, empty),
                 ("a process outside a job", base, with_hook),
                 ("a worker, GRADPACK_SERVE_ROLES=1", dict(base, GRADPACK_SERVE_ROLES="1", DMLC_ROLE="worker"),
                  with_hook)]
        print("python start, median of %d runs each (alternated)" % args.runs)
        for name, env, other in cases:
            times = {other: [], without: []}
            for _ in range(args.runs):
                for d in (without, other):
                    times[d].append(start_time(d, env))
            a, b = statistics.median(times[without]), statistics.median(times[other])
            print("  %-34s without %.2f ms   with %.2f ms   ratio %.3f" % (name, a * 1e3, b * 1e3, b / a))


if __name__ == "__main__":
    main()
