"""Two network namespaces joined by a veth pair whose ends are shaped with tc
(tbf): the limited link of the benchmarks that measure one (root only);
and the 2-node gloo jobs the torch benchmarks start over it or loopback."""
import json
import os
import subprocess
import sys
import tempfile
import time


def sh(cmd):
    subprocess.run(cmd, shell=True, check=True)


def up(namespaces, devices, addrs, rate, burst="1mb"):
    """Namespaces `namespaces` (two), joined by veth ends `devices` with
    addresses `addrs` (/24), each end limited to `rate` (tc's units)."""
    down(namespaces)
    a, b = namespaces
    sh("ip netns add %s && ip netns add %s" % (a, b))
    sh("ip link add %s type veth peer name %s" % devices)
    sh("ip link set %s netns %s && ip link set %s netns %s" % (devices[0], a, devices[1], b))
    for ns, dev, addr in zip(namespaces, devices, addrs):
        sh("ip netns exec %s ip addr add %s/24 dev %s" % (ns, addr, dev))
        sh("ip netns exec %s ip link set %s up && ip netns exec %s ip link set lo up" % (ns, dev, ns))
        sh("ip netns exec %s tc qdisc add dev %s root tbf rate %s burst %s latency 100ms" % (ns, dev, rate, burst))


def down(namespaces):
    for ns in namespaces:
        subprocess.run("ip netns del %s" % ns, shell=True, stderr=subprocess.DEVNULL)


def run_nodes(script, argv, link, per_node, namespaces, devices, addrs, timeout=3600):
    """Starts `script --rank-main --out OUT argv` as 2 "nodes" of
    `per_node` ranks each, with the variables torchrun sets (in
    `namespaces` when `link` is a rate: a node's ranks share its namespace,
    gloo on its veth end of `devices`, and reach each other over its
    loopback); returns (what rank 0 wrote to OUT, None), or (None, the end
    of every rank's output) when a rank failed."""
    out = tempfile.mktemp(suffix=".json")
    port = str(20000 + int(time.time() * 1000) % 20000)
    procs = []
    world = 2 * per_node
    for rank in range(world):
        node = rank // per_node
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=port, OMP_NUM_THREADS="1",
                   MASTER_ADDR=addrs[0] if link else "127.0.0.1", LOCAL_RANK=str(rank % per_node),
                   LOCAL_WORLD_SIZE=str(per_node))
        cmd = [sys.executable, os.path.abspath(script), "--rank-main", "--out", out] + argv
        if link:
            env["GLOO_SOCKET_IFNAME"] = devices[node]
            cmd = ["ip", "netns", "exec", namespaces[node]] + cmd
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        return None, "\n".join(l[-2000:] for l in logs)
    with open(out) as f:
        return json.load(f), None
