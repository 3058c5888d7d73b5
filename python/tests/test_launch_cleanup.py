"""gradpack.launch leaves no process behind when it is stopped by a signal
(SIGINT, SIGTERM, SIGHUP: it stops its job) or killed (SIGKILL: Linux's parent-death
signal ends its processes). Real processes: a scheduler, servers and workers
that never end by themselves; the timeouts only turn a hang into a failure."""
import os
import signal
import subprocess
import sys
import time

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts")
WORKERS, SERVERS = 2, 2

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc; the parent-death signal is Linux's")


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signalled_launcher_leaves_no_process_behind(tmp_path, sig):
    err_path = tmp_path / "launcher.err"
    pid_files = [tmp_path / ("worker%d.pid" % r) for r in range(WORKERS)]
    procs = {}
    with open(str(err_path), "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "gradpack.launch", "-n", str(WORKERS), "-s", str(SERVERS),
                                     sys.executable, os.path.join(SCRIPTS, "joins_and_waits.py")],
                                    env=dict(os.environ, GRADPACK_TEST_OUT=str(tmp_path)), stderr=err,
                                    preexec_fn=default_signals)
    try:
        # Every worker joined (so the scheduler and the servers run) and recorded its pid.
        wait_for(lambda: launcher.poll() is not None or all(p.exists() for p in pid_files), 180,
                 lambda: "the workers did not all start: " + err_path.read_text())
        assert launcher.poll() is None, err_path.read_text()
        procs = descendants(launcher.pid)
        workers = [int(p.read_text()) for p in pid_files]
        assert set(workers) <= set(procs) and len(procs) == 1 + SERVERS + WORKERS, (procs, workers)

        launcher.send_signal(sig)
        launcher.wait(timeout=60)
        wait_for(lambda: not any(alive(pid, start) for pid, start in procs.items()), 30,
                 lambda: "still running after %s to the launcher: %s" % (
                     sig.name, [pid for pid, start in procs.items() if alive(pid, start)]))
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
