"""scripts/env.sh --check: the set-up decides each Debian dependency by dpkg, and
the check fails whenever dpkg and the file the build uses disagree. Run here
against a made-up root and a dpkg-query stand-in."""
import os
import stat
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MULTIARCH = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True).stdout.strip() or "x86_64-linux-gnu"
FILES = {
    "openmpi-bin": "usr/bin/mpirun.openmpi",
    "libopenmpi3": "usr/lib/%s/libmpi.so.40" % MULTIARCH,
}

FAKE_DPKG_QUERY = """#!/bin/sh
# dpkg-query -W -f='${Status}' NAME, answered from $FAKE_INSTALLED
for name; do :; done
case " $FAKE_INSTALLED " in
  *" $name "*) printf 'install ok installed' ;;
  *) echo "dpkg-query: no packages found matching $name" >&2; exit 1 ;;
esac
"""


def check(tmp_path, installed, files):
    sysroot = tmp_path / "root"
    for rel in files:
        path = sysroot / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    fake = tmp_path / "dpkg-query"
    fake.write_text(FAKE_DPKG_QUERY)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, GRADPACK_SYSROOT=str(sysroot) + "/", GRADPACK_DPKG_QUERY=str(fake),
               FAKE_INSTALLED=" ".join(installed))
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "env.sh"), "--check"], env=env,
                         capture_output=True, text=True, timeout=60)
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.split() and line.split()[0] in FILES}
    assert set(lines) == set(FILES), out.stdout
    return out, lines


def test_every_dependency_installed_passes(tmp_path):
    out, lines = check(tmp_path, FILES, FILES.values())
    assert out.returncode == 0, out.stdout + out.stderr
    assert all(line.endswith("| ok") for line in lines.values()), out.stdout


def test_a_missing_package_is_named(tmp_path):
    files = [f for name, f in FILES.items() if name != "libopenmpi3"]
    out, lines = check(tmp_path, [n for n in FILES if n != "libopenmpi3"], files)
    assert out.returncode == 1
    assert "MISSING" in lines["libopenmpi3"] and "dpkg: not known to dpkg" in lines["libopenmpi3"], out.stdout
    assert "disagree" in out.stderr
    assert lines["openmpi-bin"].endswith("| ok"), out.stdout


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_file_without_its_package_disagrees(tmp_path, name):
    out, lines = check(tmp_path, [n for n in FILES if n != name], FILES.values())
    assert out.returncode == 1
    assert "DISAGREE" in lines[name] and "exists, but dpkg says" in lines[name], out.stdout


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_package_without_its_file_disagrees(tmp_path, name):
    out, lines = check(tmp_path, FILES, [f for n, f in FILES.items() if n != name])
    assert out.returncode == 1
    assert "DISAGREE" in lines[name] and "is missing" in lines[name], out.stdout


def test_this_machine_agrees_with_dpkg():
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "env.sh"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
