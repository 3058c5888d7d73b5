"""MXNet's launch contract: the same script for every role, DMLC_* variables
set by the launcher (what MXNet's tools/launch.py does with its local
tracker, done here by hand). gradpack must serve the scheduler and server
roles when the script imports gradpack.mxnet first, and its workers must fail
fast, saying what to change, when MXNet's ps-lite took those roles instead."""
import json
import os
import subprocess
import sys
import time

import pytest

from mxnet_required import mxnet

mxnet()
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist_scripts", "mxnet_launch_contract.py")


from gradpack.launch import free_port  # below the ephemeral range: no node of the job takes it first


def start_the_mxnet_way(order, out_dir, workers=2, servers=1, compression="2bit", **env):
    """One process per role, all running SCRIPT, as MXNet's local tracker starts them."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "PS_"))}
    base.update(DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()), DMLC_NUM_WORKER=str(workers),
                DMLC_NUM_SERVER=str(servers), GRADPACK_TEST_OUT=str(out_dir), PYTHONUNBUFFERED="1", **env)
    procs = {}
    for role, count in (("scheduler", 1), ("server", servers), ("worker", workers)):
        for i in range(count):
            procs["%s%d" % (role, i)] = subprocess.Popen(
                [sys.executable, SCRIPT, order, compression], env=dict(base, DMLC_ROLE=role),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return procs


def finish(procs, timeout):
    results = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=timeout)
            results[name] = (p.returncode, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def test_gradpack_first_serves_every_role_and_every_process_exits_0(tmp_path):
    results = finish(start_the_mxnet_way("gradpack-first", tmp_path, PS_HEARTBEAT_TIMEOUT="20"), timeout=240)
    for name, (code, err) in results.items():
        assert code == 0, (name, err[-3000:])
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            res = json.load(f)
        # Each worker: 0.3 -> nothing, 0.6 -> 0.5, 0.4 -> nothing, 0.7 -> 0.5;
        # without an optimizer the servers keep the latest sum of 2 workers.
        assert res["pulled"] == [[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0] * 4], res
        # The float16 key: its 0.3 rounds to 0.2998, still the same codes.
        assert res["pulled16"] == [["float16"] + row for row in res["pulled"]], res
        assert res["type"] == "GradpackStore"


def test_mxnet_first_makes_gradpack_workers_fail_fast_saying_what_to_change(tmp_path):
    """The first worker to register meets ps-lite's scheduler, which aborts;
    the others find nothing listening any more. Each fails with the rule
    (the default heartbeat timeout, 10 s, bounds the wait)."""
    procs = start_the_mxnet_way("mxnet-first", tmp_path)
    start = time.monotonic()
    workers = {n: p for n, p in procs.items() if n.startswith("worker")}
    try:
        for name, p in workers.items():
            _, err = p.communicate(timeout=60)
            elapsed = time.monotonic() - start
            assert p.returncode != 0, name
            assert "MXNet's own ps-lite" in err and "import gradpack.mxnet before mxnet" in err, err[-3000:]
            assert elapsed < 30, "the worker took %.0f s to fail" % elapsed
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.communicate()


def processes_of(out_dir):
    """PIDs of live processes whose environment names this test's out_dir."""
    marker = ("GRADPACK_TEST_OUT=%s" % out_dir).encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/environ" % pid, "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                pass  # it ended, or it is not ours to read
    return found


def qsgd_on_a_device_store(pushed):
    """What the qsgd_mn run must pull: a device store with the gradients the
    two workers pushed (`pushed[rank][step]`) as its two devices gives the
    same bits (README)."""
    import numpy as np
    import gradpack.kv
    kv = gradpack.kv.create("device")
    kv.set_compress({"compress": "qsgd_mn", "bits": 2, "seed": 1})
    kv.init(3, np.ones(4, np.float32))
    seen = []
    for step in range(4):
        kv.push(3, [np.array(p[step], np.float32) for p in pushed])
        out = np.zeros(4, np.float32)
        kv.pull(3, out=out)
        seen.append(out.tolist())
    return seen


@pytest.mark.parametrize("compression", ["2bit", "qsgd_mn"])
def test_mxnet_first_is_served_by_gradpack_with_the_startup_hook(tmp_path, compression):
    """GRADPACK_SERVE_ROLES=1 in the launcher's environment: the same
    mxnet-first script, unchanged, now gets gradpack's scheduler and server
    (the start-up hook serves before the script runs); exact values, every
    process exits 0 and none is left."""
    procs = start_the_mxnet_way("mxnet-first", tmp_path, compression=compression, GRADPACK_SERVE_ROLES="1",
                                PS_HEARTBEAT_TIMEOUT="20")
    results = finish(procs, timeout=240)
    for name, (code, err) in results.items():
        assert code == 0, (name, err[-3000:])
    results = []
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            results.append(json.load(f))
    if compression == "2bit":
        expected = [[0.0] * 4, [1.0] * 4, [0.0] * 4, [1.0] * 4]  # as in the gradpack-first test above
    else:
        pushed = [res["pushed"] for res in results]
        assert pushed[0] != pushed[1] and pushed[0][0] != pushed[0][1]  # ranks and steps differ
        expected = qsgd_on_a_device_store(pushed)
        assert expected[0] != expected[1]  # the steps differ: a real comparison
    for res in results:
        assert res["pulled"] == expected, (res, expected)
        assert res["type"] == "GradpackStore"
    deadline = time.monotonic() + 10
    while processes_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(tmp_path) == []
