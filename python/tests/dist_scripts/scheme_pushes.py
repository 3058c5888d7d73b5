"""A worker of test_dist.py: the compression scheme in $GRADPACK_TEST_PARAMS
(JSON) on a dist_sync store, against a 'device' store in this process with
one device per worker; writes the largest difference it saw, the bytes it
sent over the rounds, the pulls answered without asking the servers and
the kernels it ran. $GRADPACK_TEST_SHAPE (rows,cols) sets the key's shape
(8 x 12 by default); with $GRADPACK_TEST_SGD both stores run SGD at
learning rate 1, the servers on the sums they decode. $GRADPACK_TEST_GRADS
'zero_first' makes every worker's first gradient zero, 'spike' multiplies
worker 1's second by 1e10 (PowerSGD's collapsed factors), 'overflow' makes
every worker's second 3e38 (PowerSGD's P sum passes float32: an error on
every worker, reported with the key's states unchanged); then four steps."""
import json
import os

import numpy as np

import gradpack

params = json.loads(os.environ["GRADPACK_TEST_PARAMS"])
kv = gradpack.kv.create("dist_sync")
rank, workers = kv.rank, kv.num_workers
kv.set_compress(params)
device = gradpack.kv.create("device")
device.set_compress(params)
if os.environ.get("GRADPACK_TEST_SGD"):
    kv.set_optimizer("sgd", learning_rate=1.0)
    device.set_optimizer("sgd", learning_rate=1.0)
shape = tuple(int(d) for d in os.environ.get("GRADPACK_TEST_SHAPE", "8,12").split(","))
kv.init("w", np.zeros(shape, np.float32))
device.init("w", np.zeros(shape, np.float32))
kv.barrier()  # rank 0's init is sent before the count starts
sent_before = kv.stats()["bytes_sent"]


GRADS = os.environ.get("GRADPACK_TEST_GRADS", "")


def grad(r, step):
    g = np.random.default_rng(1000 * r + step).standard_normal(shape).astype(np.float32)
    if GRADS == "zero_first" and step == 0:
        g[:] = 0
    if GRADS == "spike" and step == 1 and r == 1:
        g *= np.float32(1e10)
    if GRADS == "overflow" and step == 1:
        g[:] = np.float32(3e38)
    return g


worst, sizes = 0.0, []
errors = []
for step in range(4 if GRADS else 3):
    got, want = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    if GRADS == "overflow" and step == 1:
        # The push returns; its round's error comes with the pull, on every worker.
        kv.push("w", grad(rank, step))
        for push_or_pull in (lambda: device.push("w", [grad(r, step) for r in range(workers)]), lambda: kv.pull("w", out=got)):
            try:
                push_or_pull()
                errors.append(None)
            except gradpack.Error as e:
                errors.append(str(e))
        kv.barrier()
        continue
    kv.push("w", grad(rank, step))
    device.push("w", [grad(r, step) for r in range(workers)])
    kv.pull("w", out=got)
    device.pull("w", out=want)
    # (relative to the step's largest value under $GRADPACK_TEST_GRADS: a spike's are 1e10)
    worst = max(worst, float(np.abs(got - want).max() / (max(1.0, np.abs(want).max()) if GRADS else 1.0)))
    sizes.append(float(np.abs(got).max()))
    kv.barrier()
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % rank), "w") as f:
    stats = kv.stats()
    json.dump({"max_diff": worst, "max_abs": sizes, "errors": errors, "bytes_sent": stats["bytes_sent"] - sent_before, "local_pulls": stats["local_pulls"],
               "scheme_kernel": gradpack.scheme_kernel_name(), "codec_kernel": gradpack.kernel_name()}, f)
