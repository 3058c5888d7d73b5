"""Worker of benches/kvstore_dist.py: times push+pull of one large key on a
dist_sync store (gradpack's or MXNet's), writes rank 0's figures as JSON.

argv: impl(gradpack|mxnet) compress(0|1|compress_params JSON) elements iterations out.json
(a key of 4096 rows when the size allows, so PowerSGD sees a matrix)"""
import json
import sys
import time

import numpy as np

impl, n, iters, out_path = sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
params = json.loads(sys.argv[2]) if sys.argv[2].startswith("{") else None
compress = sys.argv[2] == "1" or params is not None
shape = (4096, n // 4096) if n % 4096 == 0 else (n,)
grad_np = np.random.default_rng(0).uniform(-1, 1, n).astype(np.float32).reshape(shape)

if impl == "gradpack":
    import gradpack
    kv = gradpack.kv.create("dist_sync")
    if compress:
        kv.set_compress(params or {"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
    kv.init(0, np.zeros(shape, np.float32))
    out = np.empty(shape, np.float32)

    def step():
        kv.push(0, grad_np)
        kv.pull(0, out=out)

    def sent():
        return kv.stats()["bytes_sent"]
else:
    import mxnet as mx
    kv = mx.kv.create("dist_sync")
    if compress:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(0, mx.nd.zeros(n))
    grad = mx.nd.array(grad_np.ravel())
    out = mx.nd.empty(n)

    def step():
        kv.push(0, grad)
        kv.pull(0, out=out)
        out.wait_to_read()

    def sent():
        return 0

step()  # warm-up: allocations, residuals, connections
kv.barrier() if impl == "gradpack" else kv._barrier()
times = []
before = sent()
for _ in range(iters):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
per_iter_bytes = (sent() - before) / iters
if kv.rank == 0:
    with open(out_path, "w") as f:
        json.dump({"median_s": float(np.median(times)), "times": times, "bytes_sent_per_iter": per_iter_bytes}, f)
