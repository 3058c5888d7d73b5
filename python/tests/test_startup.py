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


def test_a_bad_setting_is_named_and_the_process_exits():
    r = run("print('the script ran')", GRADPACK_SERVE_ROLES="yes", DMLC_ROLE="server")
    assert r.returncode == 2
    assert "the script ran" not in r.stdout
    assert "GRADPACK_SERVE_ROLES must be 1" in r.stderr and "'yes'" in r.stderr


def test_a_server_serves_before_the_script_runs_and_reports_a_dead_job():
    """No scheduler listens: the hook's server fails (exit 1) with gradpack's
    error, and the script itself never ran."""
    from gradpack.launch import free_port
    r = run("print('the script ran')", GRADPACK_SERVE_ROLES="1", DMLC_ROLE="server", DMLC_PS_ROOT_URI="127.0.0.1",
            DMLC_PS_ROOT_PORT=str(free_port()), DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", PS_HEARTBEAT_TIMEOUT="2")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "the script ran" not in r.stdout
    assert "gradpack server:" in r.stderr and "scheduler" in r.stderr, r.stderr
