"""A script run the MXNet way (test_mxnet_launch.py): the same file for every
role, DMLC_ROLE set by the launcher. argv[1] 'gradpack-first' imports
gradpack.mxnet before mxnet (the rule); 'mxnet-first' the other way round, so
that MXNet's ps-lite takes the scheduler and server roles (unless
GRADPACK_SERVE_ROLES=1 hands them to gradpack's start-up hook). argv[2]
'2bit' (the default): a worker pushes 0.3 four times on a 2-bit dist_sync
store, to a float32 and a float16 key; 'qsgd_mn': it pushes
a gradient that differs by rank and step under qsgd_mn (2 bits, seed 1) to
the float32 key, and writes the gradients too. It writes what it pulled."""
import json
import os
import sys

if sys.argv[1] == "gradpack-first":
    import gradpack.mxnet as gpmx  # in a scheduler or server process: serves, then exits
    import mxnet as mx
else:
    import mxnet as mx  # in a scheduler or server process: MXNet's ps-lite serves, then exits
    import gradpack.mxnet as gpmx

import numpy as np

compression = sys.argv[2] if len(sys.argv) > 2 else "2bit"


gpmx.install()
kv = mx.kv.create("dist_sync")
if compression == "qsgd_mn":
    kv.set_compress({"compress": "qsgd_mn", "bits": 2, "seed": 1})
    kv.init(3, mx.nd.ones((4,)))
    seen, pushed = [], []
    for step in range(4):
        grad = np.array([0.3, -0.1, 0.05, 0.2], np.float32) * (step + 1) * (kv.rank + 1)
        kv.push(3, mx.nd.array(grad))
        out = mx.nd.zeros((4,))
        kv.pull(3, out=out)
        seen.append(out.asnumpy().tolist())
        pushed.append(grad.tolist())
    with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % kv.rank), "w") as f:
        json.dump({"pulled": seen, "pushed": pushed, "type": type(kv).__name__}, f)
    sys.exit(0)
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
