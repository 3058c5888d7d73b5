"""The opt-in start-up hook (gradpack/_startup.py, installed as
gradpack-startup.pth in site-packages): it acts only in a process with
GRADPACK_SERVE_ROLES set and DMLC_ROLE scheduler or server, and every other
process imports nothing of gradpack at start."""
import os
import subprocess
import sys
import sysconfig

import pytest

PROBE = "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'gradpack'))"


def run(code, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "GRADPACK_SERVE"))}
    return subprocess.run([sys.executable, "-c", code], env=dict(base, **env), capture_output=True, text=True,
                          timeout=60)


def test_the_hook_is_installed_beside_the_package():
    import gradpack
    site = os.path.dirname(os.path.dirname(os.path.abspath(gradpack.__file__)))
    with open(os.path.join(site, "gradpack-startup.pth")) as f:
        line = f.read()
    assert line.startswith("import os; ") and "gradpack._startup" in line
    assert site in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])


@pytest.mark.parametrize("env", [
    {},
    {"GRADPACK_SERVE_ROLES": "1"},  # no role
    {"GRADPACK_SERVE_ROLES": "1", "DMLC_ROLE": "worker"},
    {"GRADPACK_SERVE_ROLES": "0", "DMLC_ROLE": "server"},
    {"DMLC_ROLE": "scheduler"},  # not opted in: nothing changes
])
def test_every_other_process_starts_without_gradpack(env):
    r = run(PROBE, **env)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (env, r.stdout, r.stderr)


REPO_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hooked(code, **env):
    """Runs `code` after the repository's gradpack-startup.pth line, read as
    site.py reads it at start-up (site.addsitedir), so that the line under
    test is this checkout's whether or not gradpack is installed."""
    return run("import site; site.addsitedir(%r)\n%s" % (REPO_PYTHON, code), **env)


def dead_job(**env):
    """A server's launch variables with no scheduler listening."""
    from gradpack.launch import free_port
    return dict(DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()), DMLC_NUM_WORKER="1",
                DMLC_NUM_SERVER="1", PS_HEARTBEAT_TIMEOUT="2", **env)


@pytest.mark.parametrize("value", ["", " ", " 0 ", "false", "No", "OFF"])
def test_a_false_or_empty_setting_leaves_the_process_alone(value):
    r = hooked(PROBE, GRADPACK_SERVE_ROLES=value, DMLC_ROLE="server")
    assert r.returncode == 0 and r.stdout.strip() == "[]", (value, r.stdout, r.stderr)
    assert r.stderr == "", r.stderr


@pytest.mark.parametrize("value", ["maybe", "2", "y"])
def test_an_unknown_setting_is_a_warning_and_the_program_runs(value):
    r = hooked("print('the script ran')", GRADPACK_SERVE_ROLES=value, DMLC_ROLE="server")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout == "the script ran\n"
    assert "gradpack: warning: GRADPACK_SERVE_ROLES=%r is not one of 1/0, true/false, yes/no, on/off" % value \
        in r.stderr, r.stderr


@pytest.mark.parametrize("value,role", [("yes", "server"), (" 1", "server"), ("True", "server"), ("on", " server "),
                                        ("1", "server\t")])
def test_every_true_spelling_and_a_padded_role_serve(value, role):
    """No scheduler listens: the hook's server fails (exit 1) with gradpack's
    error before the script runs."""
    r = hooked("print('the script ran')", **dead_job(GRADPACK_SERVE_ROLES=value, DMLC_ROLE=role))
    assert r.returncode == 1, (value, role, r.stdout, r.stderr)
    assert "the script ran" not in r.stdout
    assert "gradpack server:" in r.stderr and "scheduler" in r.stderr, r.stderr


@pytest.mark.parametrize("var", ["PS_HEARTBEAT_INTERVAL", "PS_HEARTBEAT_TIMEOUT"])
def test_a_duration_out_of_range_is_named(var):
    env = dead_job(GRADPACK_SERVE_ROLES="1", DMLC_ROLE="server")
    env[var] = "1e300"
    r = hooked("print('the script ran')", **env)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert ("gradpack server: invalid parameter '%s': must be a number of seconds from 0.001 to 1000000, "
            "got '1e300'" % var) in r.stderr, r.stderr


def test_a_server_serves_before_the_script_runs_and_reports_a_dead_job():
    """No scheduler listens: the hook's server fails (exit 1) with gradpack's
    error, and the script itself never ran."""
    from gradpack.launch import free_port
    r = run("print('the script ran')", GRADPACK_SERVE_ROLES="1", DMLC_ROLE="server", DMLC_PS_ROOT_URI="127.0.0.1",
            DMLC_PS_ROOT_PORT=str(free_port()), DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", PS_HEARTBEAT_TIMEOUT="2")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "the script ran" not in r.stdout
    assert "gradpack server:" in r.stderr and "scheduler" in r.stderr, r.stderr
