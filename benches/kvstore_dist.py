"""Distributed KVStore benchmark: 2 workers and 2 servers, push+pull of one
16M-element key; gradpack compressed and uncompressed beside MXNet 1.9.1's
dist_sync with and without its built-in 2-bit compression, all in this run.

  .venv/bin/python benches/kvstore_dist.py            # loopback
  .venv/bin/python benches/kvstore_dist.py --netns    # workers and servers on two
        network namespaces joined by a veth pair limited to 1 Gbit/s with tc (root)
  add --schemes for issue 6's schemes (qsgd_mn, qsgd_mn_ts, qsgd_mn_ms, grandk_mn, grandk_mn_ts, powersgd, 1bit)
  add --auth for gradpack with GRADPACK_SECRET set (every message MACed) beside it without

Every process is started by hand with MXNet's DMLC_* variables (MXNet's own
launcher crashes on Python 3.11)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import veth

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
NS = ("gpbench_a", "gpbench_b")  # workers, servers+scheduler
ADDR = ("10.77.0.1", "10.77.0.2")


def netns_up(rate):
    veth.up(NS, ("gpveth_a", "gpveth_b"), ADDR, rate)


def netns_down():
    veth.down(NS)


def run_job(impl, compress, n, iters, netns, timeout=900):
    out = tempfile.mktemp(suffix=".json")
    port = 9000 + int(time.time() * 1000) % 2000
    root = ADDR[1] if netns else "127.0.0.1"
    base = dict(os.environ, DMLC_PS_ROOT_URI=root, DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_WORKER="2",
                DMLC_NUM_SERVER="2", PS_HEARTBEAT_TIMEOUT="60", OMP_NUM_THREADS="1")
    base.pop("GRADPACK_SECRET", None)
    base.pop("GRADPACK_SECRET_FILE", None)
    if impl == "gradpack+secret":
        base["GRADPACK_SECRET"] = os.urandom(16).hex()
        impl = "gradpack"
    node = [PY, "-m", "gradpack.node"] if impl == "gradpack" else [PY, "-c", "import mxnet"]
    flag = json.dumps(compress) if isinstance(compress, dict) else ("1" if compress else "0")
    worker = [PY, os.path.join(HERE, "dist_worker.py"), impl, flag, str(n), str(iters), out]
    procs = []

    def start(role, argv, side):
        env = dict(base, DMLC_ROLE=role)
        if netns:
            env["DMLC_NODE_HOST"] = ADDR[side]
            argv = ["ip", "netns", "exec", NS[side]] + argv
        procs.append((role, subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))

    start("scheduler", node, 1)
    start("server", node, 1)
    start("server", node, 1)
    start("worker", worker, 0)
    start("worker", worker, 0)
    try:
        t0 = time.time()
        for role, p in procs:
            if role == "worker":
                p.wait(timeout=max(1, timeout - (time.time() - t0)))
                if p.returncode != 0:
                    raise RuntimeError("%s worker failed: %s" % (impl, p.stderr.read().decode()[-2000:]))
        with open(out) as f:
            return json.load(f)
    finally:
        time.sleep(1)
        for _, p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if os.path.exists(out):
            os.remove(out)


# Issue 6's schemes, every one: the key is cut into slices dealt round the servers; each
# server sums its slices' codes and decodes them once.
SCHEMES = {
    "qsgd_mn 2": {"compress": "qsgd_mn", "bits": 2},
    "qsgd_mn 8": {"compress": "qsgd_mn", "bits": 8},
    "qsgd_mn_ts [2,6]": {"compress": "qsgd_mn_ts", "bits": [2, 6]},
    "qsgd_mn_ms [2,4,8]": {"compress": "qsgd_mn_ms", "bits": [2, 4, 8]},
    "grandk_mn k=n/16 b=8": {"compress": "grandk_mn", "bits": 8, "k": 1 << 20},
    "grandk_mn_ts k=n/16 [2,6]": {"compress": "grandk_mn_ts", "bits": [2, 6], "k": 1 << 20},
    "powersgd r=4": {"compress": "powersgd", "rank": 4},
    "1bit": {"compress": "1bit"},
}


def key(case):
    """A hashable name for a case: (impl, False/True/scheme name)."""
    impl, compress = case
    if isinstance(compress, dict):
        return impl, next(n for n, p in SCHEMES.items() if p == compress)
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--netns", action="store_true", help="1 Gbit/s link between two namespaces (root)")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--skip-mxnet", action="store_true")
    ap.add_argument("--schemes", action="store_true", help="also issue 6's schemes (a 16 Mi key is cut over both servers, as MXNet cuts keys above MXNET_KVSTORE_BIGARRAY_BOUND)")
    ap.add_argument("--auth", action="store_true", help="also gradpack with GRADPACK_SECRET (authenticated messages)")
    args = ap.parse_args()
    cases = [("gradpack", False), ("gradpack", True)]
    if args.auth:
        cases += [("gradpack+secret", False), ("gradpack+secret", True)]
    if args.schemes:
        cases += [("gradpack", SCHEMES[name]) for name in SCHEMES]
    if not args.skip_mxnet and not args.netns:
        cases += [("mxnet", False), ("mxnet", True)]
    if args.netns:
        netns_up(args.rate)
    try:
        results = {key(c): run_job(c[0], c[1], args.elements, args.iters, args.netns) for c in cases}
    finally:
        if args.netns:
            netns_down()
    where = "two namespaces, %s link" % args.rate if args.netns else "loopback"
    print("2 workers x 2 servers (%s), push+pull of a %d-element float32 key, median of %d iterations"
          % (where, args.elements, args.iters))
    print("%-44s %10s %18s" % ("store", "ms/iter", "bytes sent/iter"))
    names = {("gradpack", False): "gradpack dist_sync, no compression",
             ("gradpack", True): "gradpack dist_sync, 2bit +-0.5",
             ("mxnet", False): "MXNet 1.9.1 dist_sync, no compression",
             ("mxnet", True): "MXNet 1.9.1 dist_sync, 2bit 0.5"}
    names.update({("gradpack", name): "gradpack dist_sync, %s" % name for name in SCHEMES})
    names.update({("gradpack+secret", False): "gradpack dist_sync + secret, no compression",
                  ("gradpack+secret", True): "gradpack dist_sync + secret, 2bit +-0.5"})
    for c in cases:
        c = key(c)
        r = results[c]
        b = "%18d" % r["bytes_sent_per_iter"] if c[0].startswith("gradpack") else "%18s" % "n/a"
        print("%-44s %10.1f %s" % (names[c], r["median_s"] * 1e3, b))
    g0, g1 = results[("gradpack", False)], results[("gradpack", True)]
    print()
    print("gradpack uncompressed / compressed time: %.1fx" % (g0["median_s"] / g1["median_s"]))
    print("gradpack compressed push bytes / uncompressed: 1/%.1f"
          % (g0["bytes_sent_per_iter"] / g1["bytes_sent_per_iter"]))
    if ("gradpack+secret", True) in results:
        a0, a1 = results[("gradpack+secret", False)], results[("gradpack+secret", True)]
        print("with a secret / without, same run: compressed %.3fx, uncompressed %.3fx"
              % (a1["median_s"] / g1["median_s"], a0["median_s"] / g0["median_s"]))
    if ("mxnet", True) in results:
        m0, m1 = results[("mxnet", False)], results[("mxnet", True)]
        print("MXNet compressed / gradpack compressed time: %.1fx" % (m1["median_s"] / g1["median_s"]))
        print("MXNet uncompressed / gradpack compressed time: %.1fx" % (m0["median_s"] / g1["median_s"]))


if __name__ == "__main__":
    main()
