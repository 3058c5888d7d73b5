"""A script run the MXNet way (test_mxnet_launch.py): the same file for every
role, DMLC_ROLE set by the launcher. argv[1] 'gradpack-first' imports
gradpack.mxnet before mxnet (the rule); 'mxnet-first' the other way round, so
that MXNet's ps-lite takes the scheduler and server roles. A worker pushes
0.3 four times on a 2-bit dist_sync store, to a float32 and a float16 key,
and writes what it pulled."""
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
kv.init(5, mx.nd.ones((4,), dtype="float16"))
seen, seen16 = [], []
for _ in range(4):
    kv.push(3, mx.nd.ones((4,)) * 0.3)
    kv.push(5, mx.nd.ones((4,), dtype="float16") * 0.3)
    out, out16 = mx.nd.zeros((4,)), mx.nd.zeros((4,), dtype="float16")
    kv.pull(3, out=out)
    kv.pull(5, out=out16)
    seen.append(out.asnumpy().tolist())
    seen16.append([out16.dtype.__name__] + out16.asnumpy().astype(float).tolist())
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % kv.rank), "w") as f:
    json.dump({"pulled": seen, "pulled16": seen16, "type": type(kv).__name__}, f)
