"""A worker of test_dist.py: worker 0 pushes key 0 then key 1, worker 1 key 1
then key 0 (under the compression in $GRADPACK_TEST_PARAMS, JSON), then
each pulls both; writes the pulled values."""
import json
import os

import numpy as np

import gradpack

kv = gradpack.kv.create("dist_sync")
params = json.loads(os.environ["GRADPACK_TEST_PARAMS"])
if params:
    kv.set_compress(params)
rank = kv.rank
for key in (0, 1):
    kv.init(key, np.zeros(64, np.float32))
order = [0, 1] if rank == 0 else [1, 0]
for key in order:
    kv.push(key, np.full(64, 0.5 * (key + 1), np.float32))
out = {}
for key in order:
    got = np.zeros(64, np.float32)
    kv.pull(key, out=got)
    out[str(key)] = got.tolist()
kv.barrier()
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % rank), "w") as f:
    json.dump(out, f)
