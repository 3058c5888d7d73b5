"""A worker of test_allreduce.py (2 ranks): calls that rank 1 refuses in a
front before its store sees them (a float64 gradient, an output of
another shape, a list where an array goes; gradpack.kv and the MXNet
plugin) or that its store refuses before the agreement: each fails on
both ranks, naming rank 1's cause, and the next call pairs with the next
(it used to take rank 1's next gradient). Writes what each rank saw."""
import json
import os

import numpy as np

import gradpack
import gradpack.kv as kv


def attempt(fn):
    try:
        fn()
        return None
    except gradpack.Error as e:
        return str(e)


store = kv.create("dist_sync_allreduce")
rank = store.rank
report = {"rank": rank}
store.init(0, np.zeros(4, np.float32))
out = np.zeros(4, np.float32)
bad = {
    "float64": lambda: store.pushpull(0, np.ones(4, np.float64 if rank == 1 else np.float32), out=out),
    "output shape": lambda: store.pushpull(0, np.ones(4, np.float32), out=np.zeros(5 if rank == 1 else 4, np.float32)),
    "strided output": lambda: store.pushpull(0, np.ones(4, np.float32), out=np.zeros(4, np.float32) if rank != 1
                                               else np.broadcast_to(np.zeros(1, np.float32), (4,))),
    "init list": lambda: store.init(7, [np.ones(4, np.float32)] * (2 if rank == 1 else 1)),
}
for name, call in bad.items():
    report[name] = attempt(call)
    # every rank then pushes 10 + rank: the sum is 21 on both
    store.pushpull(0, np.full(4, 10 + rank, np.float32), out=out)
    report[name + " then"] = out.tolist()
report["key 7"] = attempt(lambda: store.pull(7, out=out))

import mxnet as mx  # noqa: E402
import gradpack.mxnet  # noqa: E402,F401

mxs = mx.kv.create("gradpack_dist_sync_allreduce")
mxs.init(3, mx.nd.zeros(4))
grad = np.ones(4, np.float32) if rank == 1 else mx.nd.ones(4)  # rank 1: not an NDArray
report["mxnet numpy"] = attempt(lambda: mxs.push(3, grad))
mxs.push(3, mx.nd.ones(4) * (10 + rank))
value = mx.nd.zeros(4)
mxs.pull(3, out=value)
report["mxnet numpy then"] = value.asnumpy().tolist()
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % rank), "w") as f:
    json.dump(report, f)
