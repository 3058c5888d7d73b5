"""A worker of test_dist.py: compressed pushes on a small key and on a key
split over servers, then random gradients; writes what it pulled to
$GRADPACK_TEST_OUT/rank<r>.npz."""
import os

import numpy as np

import gradpack

store_type = os.environ.get("GRADPACK_TEST_STORE", "dist_sync")
kv = gradpack.kv.create(store_type)
rank = kv.rank
kv.set_compress({"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
results = {}
big = int(os.environ.get("GRADPACK_TEST_BIG", "1000003"))
for key, n in (("small", 20), ("big", big)):
    kv.init(key, np.arange(n, dtype=np.float32) * 0.5)
    out = np.empty(n, np.float32)
    kv.pull(key, out=out)
    results[key + "_init"] = out.copy()
    if store_type == "dist_sync":
        for i, g in enumerate((0.4, 0.1, 0.2, 0.3)):
            if i % 2:
                kv.pushpull(key, np.full(n, g, np.float32), out=out)
            else:
                kv.push(key, np.full(n, g, np.float32))
                kv.pull(key, out=out)
            results["%s_%d" % (key, i)] = out.copy()
# random gradients on a fresh key, 3 rounds
rng = np.random.default_rng(100 + rank)
kv.init("rand", np.zeros(5000, np.float32))
for i in range(3):
    kv.push("rand", rng.uniform(-0.6, 0.6, 5000).astype(np.float32))
kv.barrier()
out = np.empty(5000, np.float32)
kv.pull("rand", out=out)
results["rand"] = out
stats = kv.stats()
results["bytes_sent"] = np.array(stats["bytes_sent"])
np.savez(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.npz" % rank), **results)
