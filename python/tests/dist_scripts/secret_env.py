"""A worker of test_launch_secret.py: joins a dist_sync job, does one exact
push, and writes to $GRADPACK_TEST_OUT/worker<rank>.json a hash of the secret
it was given (never the secret), the secret file it was given with its mode
and its directory's, and the names in the environment of every process the
launcher started (its parent's children, this one included), read from
/proc/PID/environ while every node of the job still runs."""
import hashlib
import json
import os
import stat

import numpy as np

import gradpack


def secret_given():
    """GRADPACK_SECRET, or the file GRADPACK_SECRET_FILE names read as the nodes read it."""
    if "GRADPACK_SECRET" in os.environ:
        return os.environ["GRADPACK_SECRET"]
    if "GRADPACK_SECRET_FILE" not in os.environ:
        return ""
    with open(os.environ["GRADPACK_SECRET_FILE"]) as f:
        secret = f.read()
    secret = secret[:-1] if secret.endswith("\n") else secret
    return secret[:-1] if secret.endswith("\r") else secret


def launched_environments():
    """{pid: {"role": DMLC_ROLE or "", "names": [variable names]}} of the launcher's children."""
    launcher = os.getppid()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                text = f.read()
            if int(text[text.rindex(")") + 2:].split()[1]) != launcher:
                continue
            with open("/proc/%s/environ" % name, "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue  # it ended meanwhile
        found[name] = {"role": env.get(b"DMLC_ROLE", b"").decode(), "names": sorted(k.decode() for k in env)}
    return found


def modes(path):
    if not path:
        return None
    return [stat.S_IMODE(os.stat(path).st_mode), stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)]


kv = gradpack.kv.create("dist_sync")
kv.init(0, np.zeros(4, np.float32))
out = np.empty(4, np.float32)
kv.pushpull(0, np.ones(4, np.float32), out=out)
secret = secret_given()
secret_file = os.environ.get("GRADPACK_SECRET_FILE")
# Before close: the scheduler and the servers run until every worker closed.
report = {"secret_sha256": hashlib.sha256(secret.encode()).hexdigest(), "secret_len": len(secret),
          "secret_file": secret_file, "secret_file_modes": modes(secret_file),
          "launched": launched_environments(), "value": out.tolist(), "stats": kv.stats()}
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "worker%d.json" % kv.rank), "w") as f:
    json.dump(report, f)
kv.close()
