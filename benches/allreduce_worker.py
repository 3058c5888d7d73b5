"""One worker of benches/kvstore_allreduce.py (started by mpirun): pushpull of
one 4096 x 4096 float32 key on gradpack's dist_sync_allreduce store with the
given compress_params; rank 0 writes ms per iteration and bytes per push."""
import json
import sys
import time

import numpy as np

import gradpack.kv as kv

params, iters, out_path = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = kv.create("dist_sync_allreduce")
if params:
    store.set_compress(params)
shape = (4096, 4096)
store.init(0, np.zeros(shape, np.float32))
grad = np.random.default_rng(store.rank).standard_normal(shape).astype(np.float32)
out = np.empty(shape, np.float32)
store.pushpull(0, grad, out=out)  # warm-up: allocations, PowerSGD's Q
store.barrier()
before = store.stats()
t0 = time.perf_counter()
for _ in range(iters):
    store.pushpull(0, grad, out=out)
store.barrier()
ms = (time.perf_counter() - t0) / iters * 1e3
after = store.stats()
if store.rank == 0:
    with open(out_path, "w") as f:
        json.dump({"ms": ms, "wire": (after["wire_bytes"] - before["wire_bytes"]) / iters,
                   "raw": (after["raw_bytes"] - before["raw_bytes"]) / iters}, f)
