"""The distributed store with real processes and sockets on loopback, started
by gradpack's launcher: exact init and pulls, compressed pushes against a
numpy model of every worker's residual, sharded keys, async, failures."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import gradpack
import numpy_2bit

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "dist_scripts")


def launch(workers, servers, script, tmp_path, timeout=180, **env):
    full_env = dict(os.environ, GRADPACK_TEST_OUT=str(tmp_path), **dict({"PS_HEARTBEAT_TIMEOUT": "10"}, **{k: str(v) for k, v in env.items()}))
    return subprocess.run([sys.executable, "-m", "gradpack.launch", "-n", str(workers), "-s", str(servers),
                           "--timeout", str(timeout), sys.executable, os.path.join(SCRIPTS, script)],
                          env=full_env, capture_output=True, text=True, timeout=timeout + 60)


def model_rand(workers):
    total = None
    for r in range(workers):
        rng = np.random.default_rng(100 + r)
        residual = np.zeros(5000, np.float32)
        for _ in range(3):
            compr, residual = numpy_2bit.quantize(rng.uniform(-0.6, 0.6, 5000).astype(np.float32), residual, -0.5, 0.5)
        dec = numpy_2bit.dequantize(compr, 5000)
        total = dec if total is None else total + dec
    return total, dec


@pytest.mark.parametrize("workers,servers", [(1, 1), (2, 2), (3, 2)])
def test_sync_compressed_pushes(tmp_path, workers, servers):
    out = launch(workers, servers, "pushes.py", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    want_rand, _ = model_rand(workers)
    for r in range(workers):
        res = np.load(str(tmp_path / ("rank%d.npz" % r)))
        for key, n in (("small", 20), ("big", 1000003)):
            np.testing.assert_array_equal(res[key + "_init"], np.arange(n, dtype=np.float32) * 0.5)
            for i, want in enumerate((0.0, 0.5 * workers, 0.0, 0.5 * workers)):
                assert (res["%s_%d" % (key, i)] == want).all(), (key, i)
        np.testing.assert_array_equal(res["rand"], want_rand)


def test_async_applies_each_push(tmp_path):
    out = launch(2, 2, "pushes.py", tmp_path, GRADPACK_TEST_STORE="dist_async", GRADPACK_TEST_BIG=2000)
    assert out.returncode == 0, out.stderr[-3000:]
    finals = [np.load(str(tmp_path / ("rank%d.npz" % r)))["rand"] for r in range(2)]
    np.testing.assert_array_equal(finals[0], finals[1])
    lasts = []
    for r in range(2):
        rng = np.random.default_rng(100 + r)
        residual = np.zeros(5000, np.float32)
        for _ in range(3):
            compr, residual = numpy_2bit.quantize(rng.uniform(-0.6, 0.6, 5000).astype(np.float32), residual, -0.5, 0.5)
        lasts.append(numpy_2bit.dequantize(compr, 5000))
    # without an optimizer each push replaces the value: the last one to arrive wins
    assert any(np.array_equal(finals[0], last) for last in lasts)


def test_launcher_reports_a_failing_worker(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import gradpack, sys\nkv = gradpack.kv.create('dist_sync')\n"
                      "sys.exit(3 if kv.rank == 1 else 0)\n")
    # The timeout only turns a hang into a failure; the events are what is checked.
    out = subprocess.run([sys.executable, "-m", "gradpack.launch", "-n", "2", "-s", "1", sys.executable, str(script)],
                         env=dict(os.environ, PS_HEARTBEAT_TIMEOUT="3", PS_HEARTBEAT_INTERVAL="0.5"),
                         capture_output=True, text=True, timeout=120)
    # The launcher numbers workers in launch order; ranks come from registration order.
    assert out.returncode == 3
    assert re.search(r"worker [01] exited with status 3; stopping the job", out.stderr), out.stderr


def start_node(role, port, workers, servers, argv=None, preexec_fn=None, **env):
    full = dict(os.environ, DMLC_ROLE=role, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
                DMLC_NUM_WORKER=str(workers), DMLC_NUM_SERVER=str(servers), PS_HEARTBEAT_INTERVAL="0.5",
                PS_HEARTBEAT_TIMEOUT="3", **env)
    argv = argv or [sys.executable, "-m", "gradpack.node"]
    return subprocess.Popen(argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec_fn)


ONE_ROUND_WORKER = """
import numpy as np, gradpack
kv = gradpack.kv.create('dist_sync')
kv.init(0, np.zeros(8, np.float32))
out = np.empty(8, np.float32)
kv.pushpull(0, np.full(8, 0.5, np.float32), out=out)
print('value', out[0], flush=True)
kv.close()
"""


def test_idle_connections_before_registration_do_not_keep_the_job_from_starting(tmp_path):
    """1,007 idle TCP connections to a scheduler that may open 1,024 files,
    made before any node registers: it used to accept no node for good (and
    spin). ZeroMQ now closes a connection that does not finish its handshake
    within 5 s, and the job starts within 20 s and ends with exact values."""
    import resource
    import socket
    from gradpack.launch import free_port
    port = free_port()
    secret = dict(GRADPACK_SECRET="idle-connections")
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    sched = start_node("scheduler", port, 1, 1, preexec_fn=limit, **secret)
    idle = []
    try:
        deadline = time.time() + 30
        while True:
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                break
            except OSError:
                assert time.time() < deadline, "the scheduler never listened"
                time.sleep(0.1)
        idle += [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(1006)]
        script = tmp_path / "one_round.py"
        script.write_text(ONE_ROUND_WORKER)
        server = start_node("server", port, 1, 1, **secret)
        worker = start_node("worker", port, 1, 1, [sys.executable, str(script)], **secret)
        # Bounded by the handshake timeout (5 s), not ZeroMQ's default (30 s, which took 30 s here).
        out, err = worker.communicate(timeout=20)
        assert worker.returncode == 0, err[-3000:]
        assert "value 0.5" in out, out
        for p in (server, sched):
            p.wait(timeout=30)
            assert p.returncode == 0, p.stderr.read()[-3000:]
    finally:
        for s in idle:
            s.close()
        for p in (sched,) + tuple(v for k, v in locals().items() if k in ("server", "worker")):
            if p.poll() is None:
                p.kill()
            p.wait()


def listening_ports(pid):
    """The TCP ports process `pid` listens on (its sockets' inodes, found in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.append(int(fields[1].split(":")[1], 16))
    return ports


def test_garbage_during_registration_is_logged_in_few_lines(tmp_path):
    """Garbage sent to a node that is still registering used to be logged
    line by line (867k lines in 5 s). Now at most 10 lines a second and one
    line each second that counts the rest."""
    import socket
    from gradpack.launch import free_port
    port = free_port()  # no scheduler there: the worker keeps registering
    started = time.time()
    worker = start_node("worker", port, 1, 1, [sys.executable, "-c", "import gradpack; gradpack.kv.create('dist_sync')"],
                        GRADPACK_SECRET="registering")
    try:
        deadline = time.time() + 30
        while not listening_ports(worker.pid):
            assert time.time() < deadline and worker.poll() is None, "the worker never listened"
            time.sleep(0.05)
        (target,) = listening_ports(worker.pid)
        # ZeroMQ's wire protocol (ZMTP 3.0) by hand, as a DEALER: greeting,
        # READY, then messages of three one-byte frames.
        s = socket.create_connection(("127.0.0.1", target), timeout=10)
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
        greeting = b""
        while len(greeting) < 64:
            greeting += s.recv(64 - len(greeting))
        ready = b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
        s.sendall(bytes([0x04, len(ready)]) + ready)
        head = b""  # the node's READY (a short command: flags, size, body), then messages
        while len(head) < 2:
            head += s.recv(2 - len(head))
        body = b""
        while len(body) < head[1]:
            body += s.recv(head[1] - len(body))
        assert body.startswith(b"\x05READY"), body
        message = b"\x01\x01x\x01\x01y\x00\x01z" * 1000
        sent, end = 0, time.time() + 4
        while time.time() < end:
            s.sendall(message)
            sent += 1000
        time.sleep(1.5)
        s.close()
        worker.kill()
        seconds = time.time() - started
        _, err = worker.communicate(timeout=30)
        dropped = [l for l in err.splitlines() if "dropped" in l]
        assert sent > 100000, sent
        # 10 lines and a summary per second of its life, at most.
        assert 0 < len(dropped) <= 11 * (int(seconds) + 2), "%d lines for %d messages in %.1f s" % (len(dropped), sent, seconds)
        assert any("more messages" in l for l in dropped), dropped[-3:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


LOOPING_WORKER = """
import sys, numpy as np, gradpack
kv = gradpack.kv.create('dist_sync')
kv.init(0, np.zeros(1000, np.float32))
print('ready', flush=True)
try:
    while True:
        kv.pushpull(0, np.ones(1000, np.float32), out=np.empty(1000, np.float32))
except gradpack.Error as e:
    print('ERROR', e, file=sys.stderr, flush=True)
    sys.exit(2)
"""


@pytest.mark.parametrize("victim", ["worker", "server"])
def test_killing_a_node_stops_the_job_within_the_timeout(tmp_path, victim):
    from gradpack.launch import free_port
    port = free_port()
    script = tmp_path / "loop.py"
    script.write_text(LOOPING_WORKER)
    procs = {"scheduler": start_node("scheduler", port, 2, 1), "server": start_node("server", port, 2, 1)}
    procs["worker"] = start_node("worker", port, 2, 1, [sys.executable, str(script)])
    procs["other"] = start_node("worker", port, 2, 1, [sys.executable, str(script)])
    try:
        for name in ("worker", "other"):
            assert procs[name].stdout.readline().strip() == "ready", procs[name].stderr.read()
        time.sleep(0.5)
        procs[victim].send_signal(signal.SIGKILL)
        # Every other process exits with a failure (the timeout only turns a hang
        # into a failure), and the surviving worker's error names the dead node.
        for name, p in procs.items():
            if name == victim:
                continue
            p.wait(timeout=60)
            assert p.returncode != 0, name
        err = procs["other"].stderr.read()
        assert "sent no heartbeat" in err and victim in err, err
        assert "ERROR" in err, err
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.parametrize("params", [
    {"compress": "qsgd_mn", "bits": 2},
    {"compress": "qsgd_mn_ts", "bits": [2, 6]},
    {"compress": "grandk_mn", "bits": 4, "k": 20},
    {"compress": "powersgd", "rank": 2},
    {"compress": "1bit"},
], ids=lambda p: p["compress"])
@pytest.mark.parametrize("cut", ["whole", "partitioned"])
def test_schemes_on_parameter_servers_match_the_device_store(tmp_path, params, cut):
    # partitioned: a 40 x 100 key above the big-array bound in 4000-byte
    # slices, 4 of them dealt round the 2 servers (PowerSGD keeps one each)
    env = {} if cut == "whole" else {"GRADPACK_TEST_SHAPE": "40,100", "MXNET_KVSTORE_BIGARRAY_BOUND": "1000", "GRADPACK_PARTITION_BYTES": "4000"}
    out = launch(2, 2, "scheme_pushes.py", tmp_path, GRADPACK_TEST_PARAMS=json.dumps(params), **env)
    assert out.returncode == 0, out.stderr[-4000:]
    sent = []
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            res = json.load(f)
        # integer code sums decoded once on the server: the same bits; PowerSGD's
        # float32 sums in arrival order: equal to rounding
        assert res["max_diff"] <= (1e-5 if params["compress"] == "powersgd" else 0.0), res
        # every pull after a round used the values the servers answered it with
        # (PowerSGD's servers answer with the summed Q: its pulls ask)
        assert res["local_pulls"] == (0 if params["compress"] == "powersgd" else 3), res
        sent.append(res["bytes_sent"])
    # Both workers run the same exchanges and pushes: the same bytes to the transport.
    assert sent[0] > 0 and sent[0] == sent[1], sent


@pytest.mark.parametrize("grads", ["zero_first", "spike", "overflow"])
def test_powersgd_on_parameter_servers_recovers_after_a_zero_push_and_a_spike(tmp_path, grads):
    # A zero first push (or a 1e10 spike on one worker) collapses PowerSGD's
    # Q; every later round starts from a Q drawn anew from (seed, step, key),
    # as the device store does, on both workers alike.
    params = {"compress": "powersgd", "rank": 1, "seed": 1}
    out = launch(2, 2, "scheme_pushes.py", tmp_path, GRADPACK_TEST_PARAMS=json.dumps(params), GRADPACK_TEST_SHAPE="64,32",
                 GRADPACK_TEST_GRADS=grads)
    assert out.returncode == 0, out.stderr[-4000:]
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            res = json.load(f)
        assert res["max_diff"] <= 1e-5, res  # relative to the step's largest value
        assert all(np.isfinite(res["max_abs"])), res
        assert all(m > 0.1 for m in res["max_abs"][1:]), res  # alive after the first step
        if grads == "overflow":
            # the device store refuses the push; the servers' round fails on every worker
            # alike; the rounds after it match the device store's, states unchanged
            assert len(res["errors"]) == 2 and all("sum of P holds" in e and "non-finite" in e for e in res["errors"]), res


@pytest.mark.parametrize("params", [{}, {"compress": "2bit", "threshold": 0.5}, {"compress": "qsgd_mn", "bits": 2}],
                         ids=["none", "2bit", "qsgd_mn"])
def test_workers_pushing_keys_in_opposite_orders_complete(tmp_path, params):
    # Worker 0 pushes key 0 then 1, worker 1 key 1 then 0: both used to wait
    # in their first push for ever. A push returns as MXNet's does; the
    # pulls wait for the rounds.
    out = launch(2, 2, "opposite_orders.py", tmp_path, timeout=60, GRADPACK_TEST_PARAMS=json.dumps(params), PS_HEARTBEAT_TIMEOUT=5)
    assert out.returncode == 0, out.stderr[-4000:]
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            res = json.load(f)
        # 2-bit at 0.5 sends 0.5 from each worker; float32 and QSGD of a constant: the sum
        want = {"0": 1.0, "1": 1.0} if params.get("compress") == "2bit" else {"0": 1.0, "1": 2.0}
        assert {k: set(v) for k, v in res.items()} == {k: {w} for k, w in want.items()}, res


# Every scheme, at sizes whose whole vectors and groups of lanes the kernels
# take, with random-K's k = n/16 (of its 40 x 4000 key: three strata of its
# selection, the last one short).
EVERY_SCHEME = [
    {"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5},
    {"compress": "qsgd_mn", "bits": 2, "seed": 4},
    {"compress": "qsgd_mn", "bits": 8},
    {"compress": "qsgd_mn_ts", "bits": [2, 6]},
    {"compress": "qsgd_mn_ms", "bits": [2, 4, 8]},
    {"compress": "grandk_mn", "bits": 8, "k": 10000},
    {"compress": "grandk_mn_ts", "bits": [2, 4], "k": 10000},
    {"compress": "powersgd", "rank": 2},
    {"compress": "1bit"},
]


@pytest.mark.parametrize("params", EVERY_SCHEME, ids=lambda p: "%s-%s" % (p["compress"], p.get("bits", "")))
@pytest.mark.parametrize("decoder", ["workers", "servers"])
def test_nodes_on_different_kernels_give_the_device_stores_bits(tmp_path, params, decoder):
    # Machines differ: one worker runs the portable kernels, the other the
    # widest this CPU has, and both servers AVX2 (GRADPACK_KERNEL caps each
    # process). Each worker's device store quantizes every worker's push,
    # selects random-K's coordinates and decodes with its own kernels, so a
    # kernel that rounds, selects, packs or decodes one bit differently from
    # another shows as a difference on one of the two workers. The 40 x 1000
    # key (random-K's: 40 x 4000) is cut into 4 slices over the 2 servers at
    # offsets no vector aligns to.
    # Pulls decode the servers' answers on the workers; with SGD on the
    # servers, they return what the servers decoded.
    from gradpack.launch import free_port
    port = free_port()
    cols = 4000 if params["compress"].startswith("grandk") else 1000
    env = {"GRADPACK_TEST_OUT": str(tmp_path), "GRADPACK_TEST_PARAMS": json.dumps(params), "GRADPACK_TEST_SHAPE": "40,%d" % cols,
           "MXNET_KVSTORE_BIGARRAY_BOUND": "1000", "GRADPACK_PARTITION_BYTES": str(40 * cols + 4)}
    if decoder == "servers":
        env["GRADPACK_TEST_SGD"] = "1"
    script = [sys.executable, os.path.join(SCRIPTS, "scheme_pushes.py")]
    procs = {"scheduler": start_node("scheduler", port, 2, 2, **env)}
    for i in range(2):
        procs["server %d" % i] = start_node("server", port, 2, 2, GRADPACK_KERNEL="avx2", **env)
    for kernel in ("portable", "avx512"):
        procs["worker " + kernel] = start_node("worker", port, 2, 2, script, GRADPACK_KERNEL=kernel, **env)
    try:
        for name, p in procs.items():
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, "%s exited with %s: %s" % (name, p.returncode, err[-3000:])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    kernels = set()
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            res = json.load(f)
        assert res["max_diff"] == 0.0, res
        kernels.add(res["scheme_kernel"])
    # Two different kernels ran: the portable one and this CPU's widest.
    assert "portable" in kernels and len(kernels) == 2, kernels


def test_the_launchers_port_is_one_no_node_of_the_job_can_take_first():
    # Nodes' own sockets take ephemeral ports; a scheduler port from bind(0)
    # is one of those too, and was once taken between the check and the bind.
    from gradpack.launch import _ephemeral_range, free_port
    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), ports
    assert len(ports) > 1  # drawn at random, so two launches rarely meet
