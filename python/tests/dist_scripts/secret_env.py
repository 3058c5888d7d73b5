"""A worker of test_launch_secret.py: joins a dist_sync job, does one exact
push, and writes a hash of the secret it was given (never the secret) to
$GRADPACK_TEST_OUT/worker<rank>.json."""
import hashlib
import json
import os

import numpy as np

import gradpack

kv = gradpack.kv.create("dist_sync")
kv.init(0, np.zeros(4, np.float32))
out = np.empty(4, np.float32)
kv.pushpull(0, np.ones(4, np.float32), out=out)
secret = os.environ.get("GRADPACK_SECRET", "")
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "worker%d.json" % kv.rank), "w") as f:
    json.dump({"secret_sha256": hashlib.sha256(secret.encode()).hexdigest(), "secret_len": len(secret),
               "value": out.tolist(), "stats": kv.stats()}, f)
kv.close()
