"""A worker of test_dist_mxnet.py: row_sparse keys on gradpack's dist_sync
store, which holds them dense. Each worker pushes its own row (rank + 1 in
row `rank`); without an optimizer the servers keep the sum; row_sparse_pull
of rows [0, 1, 5] gives those rows of it. Writes what it pulled."""
import json
import os

import gradpack.mxnet as gpmx
import mxnet as mx

gpmx.install()
kv = mx.kv.create("dist_sync")
shape = (6, 3)
kv.init("emb", mx.nd.ones(shape).tostype("row_sparse"))
g = mx.nd.zeros(shape)
g[kv.rank] = kv.rank + 1
kv.push("emb", g.tostype("row_sparse"))
out = mx.nd.sparse.zeros("row_sparse", shape)
kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([0, 1, 5]))
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % kv.rank), "w") as f:
    json.dump({"stype": out.stype, "rows": out.asnumpy().tolist()}, f)
