"""gradpack.launch gives every process of a job the same secret, so that the
job's messages are authenticated: a new random one per job unless the caller
set GRADPACK_SECRET or GRADPACK_SECRET_FILE. Local processes get it as a file
(the caller's, or one made for the job, readable only by the user and removed
when the job ends), never in their environment, where /proc/PID/environ
shows it; only a caller's own GRADPACK_SECRET is passed on as it is. It never
appears on a command line: over ssh it travels on standard input."""
import collections
import glob
import hashlib
import json
import os
import subprocess
import sys

import pytest

from gradpack import launch

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts")


def run_job(tmp_path, env_extra, cwd=None):
    out = tmp_path / ("out%d" % len(list(tmp_path.iterdir())))
    out.mkdir()
    env = dict(os.environ, GRADPACK_TEST_OUT=str(out), **env_extra)
    for k in ("GRADPACK_SECRET", "GRADPACK_SECRET_FILE"):
        if k not in env_extra:
            env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "gradpack.launch", "-n", "2", "-s", "1",
                        sys.executable, os.path.join(SCRIPTS, "secret_env.py")],
                       env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    reports = [json.load(open(f)) for f in sorted(glob.glob(str(out / "worker*.json")))]
    assert len(reports) == 2
    assert all(r["value"] == [2.0] * 4 for r in reports)  # both workers' pushes, exactly
    # Every message of the job was authenticated: nothing was dropped.
    assert all(r["stats"]["dropped"] == 0 for r in reports), reports
    assert "GRADPACK_SECRET is not set" not in p.stderr
    return reports


def launched(reports):
    """What both workers read of every process the launcher started: the
    scheduler, the server, both workers and the launcher's watchdog."""
    procs = {}
    for r in reports:
        procs.update(r["launched"])
    roles = collections.Counter(p["role"] for p in procs.values())
    assert roles == {"scheduler": 1, "server": 1, "worker": 2, "": 1}, procs
    return procs


def assert_no_secret_in_environments(reports, secret_file):
    for pid, p in launched(reports).items():
        assert "GRADPACK_SECRET" not in p["names"], (pid, p)
        if p["role"]:
            assert "GRADPACK_SECRET_FILE" in p["names"], (pid, p)
    assert [r["secret_file"] for r in reports] == [secret_file] * 2


def test_each_job_gets_its_own_random_secret_in_a_file_removed_at_its_end(tmp_path):
    a = run_job(tmp_path, {})
    b = run_job(tmp_path, {})
    assert a[0]["secret_len"] == 64 and a[0]["secret_sha256"] == a[1]["secret_sha256"]
    assert b[0]["secret_sha256"] == b[1]["secret_sha256"] != a[0]["secret_sha256"]
    for reports in (a, b):
        path = reports[0]["secret_file"]
        assert os.path.isabs(path)
        assert_no_secret_in_environments(reports, path)
        assert reports[0]["secret_file_modes"] == [0o600, 0o700]  # the file, its private directory
        assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    assert a[0]["secret_file"] != b[0]["secret_file"]


def test_the_callers_secret_file_is_handed_on_never_its_contents(tmp_path):
    want = hashlib.sha256(b"correct horse").hexdigest()
    f = tmp_path / "secret"
    f.write_text("correct horse\n")
    r = run_job(tmp_path, {"GRADPACK_SECRET_FILE": "secret"}, cwd=str(tmp_path))  # relative: made absolute
    assert [x["secret_sha256"] for x in r] == [want, want]
    assert_no_secret_in_environments(r, str(f))
    assert f.read_text() == "correct horse\n"  # the caller's file stays


def test_the_callers_secret_is_passed_on_as_it_is(tmp_path):
    want = hashlib.sha256(b"correct horse").hexdigest()
    r = run_job(tmp_path, {"GRADPACK_SECRET": "correct horse"})
    assert [x["secret_sha256"] for x in r] == [want, want]
    assert [x["secret_file"] for x in r] == [None, None]


def test_the_ssh_command_line_carries_no_secret():
    cmd = launch.remote_command(["python", "train.py"], {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_PORT": "9"}, "/work dir")
    assert cmd.startswith("IFS= read -r GRADPACK_SECRET && export GRADPACK_SECRET")
    assert "'/work dir'" in cmd and cmd.endswith("python train.py")
    # What the remote shell does with it: the secret read from stdin reaches the command.
    p = subprocess.run(["sh", "-c", launch.remote_command(
        [sys.executable, "-c", "import os; print(os.environ['GRADPACK_SECRET'], os.environ['DMLC_ROLE'])"],
        {"DMLC_ROLE": "worker"}, os.getcwd())], input="s3cret\n", capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["s3cret", "worker"], p.stderr


def test_a_bad_secret_is_refused(tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        launch.job_secret({"GRADPACK_SECRET": "two\nlines"})
    f = tmp_path / "empty"
    f.write_text("\n")
    with pytest.raises(SystemExit):
        launch.job_secret({"GRADPACK_SECRET_FILE": str(f)})
    f.write_text("one\n")
    with pytest.raises(SystemExit):  # as the nodes refuse both
        launch.job_secret({"GRADPACK_SECRET": "one", "GRADPACK_SECRET_FILE": str(f)})
    with pytest.raises(SystemExit):  # a command line shows in ps
        launch.parse_args(["-n", "1", "--env", "GRADPACK_SECRET=one", "python", "train.py"])
    assert len(launch.job_secret({})) == 64
