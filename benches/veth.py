"""Two network namespaces joined by a veth pair whose ends are shaped with tc
(tbf): the limited link of the benchmarks that measure one (root only)."""
import subprocess


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
