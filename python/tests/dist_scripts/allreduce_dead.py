"""A worker of test_allreduce.py: rank 1 dies after init while rank 0 pushes;
mpirun must end the job (rank 0 must not wait forever in the reduction)."""
import os

import numpy as np

import gradpack.kv as kv

store = kv.create("dist_sync_allreduce")
store.init(0, np.zeros(10, np.float32))
if store.rank == 1:
    os._exit(3)
store.push(0, np.ones(10, np.float32))
print("rank 0: push returned without its peer")
