"""gradpack.launch leaves no process behind: neither the nodes it started
nor what they left running in the background (a `sleep` of each worker
command here), whether the job ends, the launcher is stopped by a signal
(SIGINT, SIGTERM, SIGHUP: it stops its job) or killed (SIGKILL: its watchdog
stops the job). Nor does it leave the secret file it made. Real processes:
a scheduler, servers and workers that never end by themselves (but in the
first test); the timeouts only turn a hang into a failure."""
import os
import signal
import subprocess
import sys
import time

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts")
WORKERS, SERVERS = 2, 2

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# Each worker command leaves a sleep running in the background, in its process
# group, and writes the sleep's pid to $GRADPACK_TEST_OUT/sleep-<shell pid>.pid.
# The shell stays (`exit $?` is its last command), so that the sleep is
# orphaned when the shell ends.
WITH_A_SLEEP = ["sh", "-c", 'sleep 300 </dev/null >/dev/null 2>&1 & echo $! > "$GRADPACK_TEST_OUT/sleep-$$.tmp"'
                ' && mv "$GRADPACK_TEST_OUT/sleep-$$.tmp" "$GRADPACK_TEST_OUT/sleep-$$.pid"; "$@"; exit $?', "sh"]
JOINS_AND_ENDS = ("import numpy as np, gradpack; kv = gradpack.kv.create('dist_sync'); "
                  "kv.init(0, np.zeros(4, np.float32)); kv.close()")


def stat(pid):
    """(parent pid, state, start time) of a process, or None when there is none."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name before ")" may hold spaces
    return int(fields[1]), fields[0], fields[19]


def descendants(root):
    """Every process below root, as {pid: start time}."""
    children = {}
    for name in os.listdir("/proc"):
        s = stat(int(name)) if name.isdigit() else None
        if s:
            children.setdefault(s[0], []).append((int(name), s[2]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def alive(pid, start):
    # A zombie has ended (whoever adopted it reaps it when it likes); another
    # start time is another process that got the same pid.
    s = stat(pid)
    return s is not None and s[1] != "Z" and s[2] == start


def default_signals():
    # Under nohup or `&` the test runner may ignore SIGHUP or SIGINT, and the
    # launcher leaves a signal ignored on entry ignored.
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def wait_for(done, timeout, why):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, why()
        time.sleep(0.1)


def launcher_env(tmp_path):
    env = dict(os.environ, GRADPACK_TEST_OUT=str(tmp_path))
    for k in ("GRADPACK_SECRET", "GRADPACK_SECRET_FILE"):
        env.pop(k, None)  # the launcher makes a secret file
    return env


def sleeps(tmp_path):
    return [int(p.read_text()) for p in tmp_path.glob("sleep-*.pid")]


def environ(pid):
    with open("/proc/%d/environ" % pid, "rb") as f:
        return dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)


def a_sleep(pid):
    """Whether pid is still one of the test's sleeps (not a zombie, not a process that got its pid)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    s = stat(pid)
    return cmdline.split(b"\0")[:2] == [b"sleep", b"300"] and s is not None and s[1] != "Z"


def test_a_job_that_ends_leaves_no_process_behind(tmp_path):
    err_path = tmp_path / "launcher.err"
    with open(str(err_path), "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "gradpack.launch", "-n", str(WORKERS), "-s", str(SERVERS)]
                                    + WITH_A_SLEEP + [sys.executable, "-c", JOINS_AND_ENDS],
                                    env=launcher_env(tmp_path), stdout=subprocess.DEVNULL, stderr=err)
    try:
        assert launcher.wait(timeout=180) == 0, err_path.read_text()
        assert len(sleeps(tmp_path)) == WORKERS
        # The job ended: each worker's shell ended and left its sleep for the launcher to end.
        wait_for(lambda: not any(a_sleep(pid) for pid in sleeps(tmp_path)), 5,
                 lambda: "still running after the job ended: %s" % [pid for pid in sleeps(tmp_path) if a_sleep(pid)])
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        for pid in sleeps(tmp_path):
            if a_sleep(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signalled_launcher_leaves_no_process_behind(tmp_path, sig):
    err_path = tmp_path / "launcher.err"
    pid_files = [tmp_path / ("worker%d.pid" % r) for r in range(WORKERS)]
    procs = {}
    with open(str(err_path), "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "gradpack.launch", "-n", str(WORKERS), "-s", str(SERVERS)]
                                    + WITH_A_SLEEP + [sys.executable, os.path.join(SCRIPTS, "joins_and_waits.py")],
                                    env=launcher_env(tmp_path), stderr=err, preexec_fn=default_signals)
    try:
        # Every worker joined (so the scheduler and the servers run), recorded its pid and left a sleep.
        wait_for(lambda: launcher.poll() is not None or (all(p.exists() for p in pid_files)
                                                         and len(sleeps(tmp_path)) == WORKERS), 180,
                 lambda: "the workers did not all start: " + err_path.read_text())
        assert launcher.poll() is None, err_path.read_text()
        procs = descendants(launcher.pid)
        workers = [int(p.read_text()) for p in pid_files]
        # The watchdog, the scheduler, the servers, and for each worker its shell, its python and its sleep.
        assert set(workers + sleeps(tmp_path)) <= set(procs) and len(procs) == 2 + SERVERS + 3 * WORKERS, (
            procs, workers)
        secret_file = environ(workers[0])[b"GRADPACK_SECRET_FILE"].decode()
        assert os.path.exists(secret_file)

        launcher.send_signal(sig)
        launcher.wait(timeout=60)
        wait_for(lambda: not any(alive(pid, start) for pid, start in procs.items()) and not os.path.exists(secret_file),
                 10, lambda: "still running after %s to the launcher: %s; secret file left: %s" % (
                     sig.name, [pid for pid, start in procs.items() if alive(pid, start)], os.path.exists(secret_file)))
        if sig == signal.SIGKILL:
            assert launcher.returncode == -sig
        else:
            assert launcher.returncode == 128 + sig, err_path.read_text()
            assert "got %s; stopping the job" % sig.name in err_path.read_text()
    finally:
        if launcher.poll() is None:
            procs.update(descendants(launcher.pid))
            launcher.kill()
        launcher.wait()
        for pid, start in procs.items():
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)
