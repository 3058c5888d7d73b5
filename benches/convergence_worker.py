"""One worker of benches/convergence.py, started by mpirun: trains the digits
MLP (64-64-10, or 64-H-10 with --hidden H) on its shard of the training set through a Gluon Trainer on
gradpack's 'dist_sync_allreduce' store with the given compress_params, and
rank 0 writes accuracy per epoch, bytes handed to MPI and time per epoch."""
import argparse
import json
import os
import sys
import time

import numpy as np

import mxnet as mx
import gradpack.mxnet as gpmx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_digits import load_data  # noqa: E402  the same split as the example


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--params", required=True, help="compress_params as JSON ({} for none)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    p.add_argument("--hidden", type=int, default=64, help="units of the hidden layer")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    params = json.loads(args.params) or None
    mx.random.seed(0)
    np.random.seed(0)
    (xtr, ytr), (xte, yte) = load_data()
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(args.hidden, activation="relu"), mx.gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu(0))
    trainer = gpmx.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                           kvstore="dist_sync_allreduce", compress_params=params)
    # The Trainer creates its store on the first step; mpirun names the ranks.
    rank, workers = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    # Each worker its own shard; a step sums every worker's gradient of a loss
    # summed over its batch, and the Trainer divides by the global batch.
    xs, ys = xtr[rank::workers], ytr[rank::workers]
    steps = min(len(x) for x in (xtr[w::workers] for w in range(workers))) // args.batch
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    acc, times = [], []
    for _ in range(args.epochs):
        t0 = time.perf_counter()
        for s in range(steps):
            xb = mx.nd.array(xs[s * args.batch:(s + 1) * args.batch])
            yb = mx.nd.array(ys[s * args.batch:(s + 1) * args.batch])
            with mx.autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(args.batch * workers)
        mx.nd.waitall()
        times.append(time.perf_counter() - t0)
        acc.append(float((net(mx.nd.array(xte)).asnumpy().argmax(axis=1) == yte).mean()))
    kv = trainer._kvstore
    assert (kv.rank, kv.num_workers) == (rank, workers)
    stats = kv.stats()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"workers": workers, "accuracy": acc, "s_per_epoch": float(np.mean(times[1:] or times)),
                       "wire_bytes": stats["wire_bytes"], "raw_bytes": stats["raw_bytes"]}, f)


if __name__ == "__main__":
    main()
