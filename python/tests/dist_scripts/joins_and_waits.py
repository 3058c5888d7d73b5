"""A worker of test_launch_cleanup.py: joins a dist_sync job, writes its pid
to $GRADPACK_TEST_OUT/worker<rank>.pid, then keeps pushing until something
stops it (it never ends by itself)."""
import os
import time

import numpy as np

import gradpack

kv = gradpack.kv.create("dist_sync")
kv.init(0, np.zeros(100, np.float32))
path = os.path.join(os.environ["GRADPACK_TEST_OUT"], "worker%d.pid" % kv.rank)
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)  # the test never reads a half-written pid
out = np.empty(100, np.float32)
while True:
    kv.pushpull(0, np.ones(100, np.float32), out=out)
    time.sleep(0.1)  # the machine's cores are shared; pushing is not what is tested
