"""A script run the MXNet way (test_mxnet_launch.py): the same file for every
role, DMLC_ROLE set by the launcher. argv[1] 'gradpack-first' imports
gradpack.mxnet before mxnet (the rule); 'mxnet-first' the other way round, so
that MXNet's ps-lite takes the scheduler and server roles. A worker pushes
0.3 four times on a 2-bit dist_sync store and writes what it pulled."""
import json
import os
import sys

if sys.argv[1] == "gradpack-first":
    import gradpack.mxnet as gpmx  # in a scheduler or server process: serves, then exits
    import mxnet as mx
else:
    import mxnet as mx  # in a scheduler or server process: MXNet's ps-lite serves, then exits
    import gradpack.mxnet as gpmx

gpmx.install()
kv = mx.kv.create("dist_sync")
kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
kv.init(3, mx.nd.ones((4,)))
seen = []
for _ in range(4):
    kv.push(3, mx.nd.ones((4,)) * 0.3)
    out = mx.nd.zeros((4,))
    kv.pull(3, out=out)
    seen.append(out.asnumpy().tolist())
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % kv.rank), "w") as f:
    json.dump({"pulled": seen, "type": type(kv).__name__}, f)
