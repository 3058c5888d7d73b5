"""A worker of test_allreduce.py (run by mpirun): every compression scheme on
gradpack.kv's 'dist_sync_allreduce' store against a 'device' store in this
process with one device per worker; writes what it saw and the kernels it
ran. $GRADPACK_TEST_SHAPE (rows,cols) sets the keys' shape (8 x 12 by
default); random-K keeps n/16 coordinates, at least 17 (30 for _ts)."""
import json
import os
import sys

import numpy as np

import gradpack
import gradpack.kv as kv

SCHEMES = [
    {"compress": "none"},
    {"compress": "2bit", "threshold": 0.3},
    {"compress": "qsgd_mn", "bits": 2, "seed": 4},
    {"compress": "qsgd_mn_ts", "bits": [2, 6]},
    {"compress": "qsgd_mn_ms", "bits": [1, 3, 8]},
    {"compress": "grandk_mn", "bits": 4, "k": 17},
    {"compress": "grandk_mn_ts", "bits": [2, 4], "k": 30},
    {"compress": "powersgd", "rank": 2},
    {"compress": "1bit", "threshold": 0.1},
]


def grad(rank, step, shape):
    rng = np.random.default_rng(1000 * rank + step)
    return rng.standard_normal(shape).astype(np.float32)


store = kv.create("dist_sync_allreduce")
rank, workers = store.rank, store.num_workers
shape = tuple(int(d) for d in os.environ.get("GRADPACK_TEST_SHAPE", "8,12").split(","))
n = int(np.prod(shape))
for params in SCHEMES:
    if "k" in params:
        params["k"] = max(params["k"], n // 16)
report = {"rank": rank, "workers": workers, "schemes": {}, "scheme_kernel": gradpack.scheme_kernel_name(),
          "codec_kernel": gradpack.kernel_name()}
for i, params in enumerate(SCHEMES):
    store = kv.create("dist_sync_allreduce")  # compression comes before init: a store per scheme
    store.set_compress(params)
    device = kv.create("device")
    if params["compress"] != "none":
        device.set_compress(params)
    store.init(i, np.zeros(shape, np.float32))
    device.init(i, np.zeros(shape, np.float32))
    before = store.stats()
    worst = 0.0
    for step in range(3):
        store.push(i, grad(rank, step, shape))
        device.push(i, [grad(w, step, shape) for w in range(workers)])
        got, want = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        store.pull(i, out=got)
        device.pull(i, out=want)
        worst = max(worst, float(np.abs(got - want).max()))
    after = store.stats()
    report["schemes"][params["compress"]] = {
        "max_diff": worst,
        "raw": after["raw_bytes"] - before["raw_bytes"],
        "wire": after["wire_bytes"] - before["wire_bytes"],
    }
# PowerSGD after a zero first push, and after a 1e10 spike on rank 1: the
# same aggregates as the device store (a collapsed Q drawn anew from the
# seed, step and key), alive after the first step.
for case in ("zero_first", "spike", "overflow"):
    params = {"compress": "powersgd", "rank": 1, "seed": 1}
    store = kv.create("dist_sync_allreduce")
    store.set_compress(params)
    device = kv.create("device")
    device.set_compress(params)
    store.init(case, np.zeros((64, 32), np.float32))
    device.init(case, np.zeros((64, 32), np.float32))
    worst, sizes = 0.0, []
    for step in range(4):
        grads = [grad(w, step, (64, 32)) * np.float32(0 if case == "zero_first" and step == 0 else 1) for w in range(workers)]
        if case == "spike" and workers > 1:
            grads[1] *= np.float32(1e10 if step == 1 else 1)
        if case == "overflow" and step == 1:
            # P's sum passes float32: the same error on every rank, states unchanged
            errors = []
            for push in (lambda: store.push(case, np.full((64, 32), 3e38, np.float32)), lambda: device.push(case, [np.full((64, 32), 3e38, np.float32)] * workers)):
                try:
                    push()
                    errors.append(None)
                except gradpack.Error as e:
                    errors.append(str(e))
            report["powersgd overflow errors"] = errors
            continue
        store.push(case, grads[rank])
        device.push(case, grads)
        got, want = np.zeros((64, 32), np.float32), np.zeros((64, 32), np.float32)
        store.pull(case, out=got)
        device.pull(case, out=want)
        worst = max(worst, float(np.abs(got - want).max() / max(1.0, np.abs(want).max())))
        sizes.append(float(np.abs(got).max()))
    report["powersgd " + case] = {"max_diff": worst, "max_abs": sizes}
try:
    store.set_compress({"compress": "qsgd_mn_ts", "bits": 4})
except gradpack.Error as e:
    report["bad_params"] = str(e)
store.barrier()
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % rank), "w") as f:
    json.dump(report, f)
