"""A worker of test_allreduce.py: both ranks push once; then rank 1's script
ends without calling close() while rank 0 pushes once more. At exit gradpack
closes rank 1's store collectively, so rank 0's extra push fails with an
error instead of waiting forever, and each rank writes what it saw."""
import json
import os

import numpy as np

import gradpack
import gradpack.kv as kv

store = kv.create("dist_sync_allreduce")
store.init(0, np.zeros(4, np.float32))
out = np.empty(4, np.float32)
store.pushpull(0, np.ones(4, np.float32), out=out)
report = {"rank": store.rank, "value": out.tolist()}
if store.rank == 0:
    try:
        store.push(0, np.ones(4, np.float32))
        report["extra"] = "returned"
    except gradpack.Error as e:
        report["extra"] = str(e)
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % store.rank), "w") as f:
    json.dump(report, f)
# rank 1 ends here: no close(); rank 0 closes at exit too (its store knows the other closed).
