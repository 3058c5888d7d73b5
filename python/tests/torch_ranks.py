"""Starts torch ranks as torchrun starts them (separate processes with
RANK, WORLD_SIZE, MASTER_ADDR/PORT), for test_torch.py and
test_torch_fsdp.py; each rank runs a script of dist_scripts/ and writes
rank<r>.json into GRADPACK_TEST_OUT."""
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(world, scenarios, tmp_path, timeout=240, script="torch_ddp.py", **env):
    """Starts `world` ranks of dist_scripts/`script` running `scenarios`;
    asserts every rank exited 0 and returns each rank's report (None for a
    rank that wrote none)."""
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                GRADPACK_TEST_OUT=str(tmp_path), **env)
    path = os.path.join(HERE, "dist_scripts", script)
    procs = [subprocess.Popen([sys.executable, path] + scenarios, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, (r, out[-4000:])
    reports = []
    for r in range(world):
        report = tmp_path / ("rank%d.json" % r)
        reports.append(json.loads(report.read_text()) if report.exists() else None)
    return reports


def torchrun(world, script, args, timeout=600):
    """Runs `script` (a path from the repository's root) under torchrun
    with `world` ranks; the finished process."""
    root = os.path.dirname(os.path.dirname(HERE))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_port", str(free_port()), os.path.join(root, script)] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
