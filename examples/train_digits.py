"""Train a small MLP on scikit-learn's bundled digits data set (nothing is
downloaded) on 2 CPU contexts, with and without gradpack's 2-bit compression,
through a real MXNet 1.9.1 Gluon Trainer (or Module), and print accuracy, the
bytes compression kept off the wire, and time per epoch.

Run: python examples/train_digits.py [--epochs N] [--api trainer|module]"""
import argparse
import time

import numpy as np

import mxnet as mx
import gradpack.mxnet as gpmx

# The threshold is on the scale of what each device pushes: here the gradient of
# a loss summed over the device's 32 samples (Trainer.step / Module rescale by
# 1/batch afterwards), whose elements are often several units. A threshold far
# below that (0.5) caps every element at +-0.5 per step and training crawls;
# 3.0 keeps accuracy within a point or two of uncompressed training.
TWO_BIT = {"compress": "2bit", "pos_threshold": 3.0, "neg_threshold": -3.0}
# gradpack's device store by name, compressed or not: without compression
# 'device' would be MXNet's own store, which counts no bytes.
STORE = "gradpack_device"


def load_data(seed=0):
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def accuracy(predict, x, y):
    return float((predict(mx.nd.array(x)).asnumpy().argmax(axis=1) == y).mean())


def train_trainer(compress, epochs=10, batch=64, lr=0.1, seed=0, ctx=None):
    ctx = ctx or [mx.cpu(0), mx.cpu(1)]
    mx.random.seed(seed)
    np.random.seed(seed)
    (xtr, ytr), (xte, yte) = load_data(seed)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(64, activation="relu"), mx.gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    trainer = gpmx.Trainer(net.collect_params(), "sgd", {"learning_rate": lr, "momentum": 0.9},
                           kvstore=STORE, compress_params=TWO_BIT if compress else None)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for i in range(0, len(xtr) - batch + 1, batch):
            xs = mx.gluon.utils.split_and_load(xtr[i:i + batch], ctx)
            ys = mx.gluon.utils.split_and_load(ytr[i:i + batch], ctx)
            with mx.autograd.record():
                losses = [loss_fn(net(xb), yb) for xb, yb in zip(xs, ys)]
            for l in losses:
                l.backward()
            trainer.step(batch)
        mx.nd.waitall()
        times.append(time.perf_counter() - t0)
    acc = accuracy(lambda x: net(x.as_in_context(ctx[0])), xte, yte)
    return acc, trainer._kvstore.stats(), float(np.mean(times))


def train_module(compress, epochs=10, batch=64, lr=0.1, seed=0, ctx=None):
    ctx = ctx or [mx.cpu(0), mx.cpu(1)]
    mx.random.seed(seed)
    np.random.seed(seed)
    (xtr, ytr), (xte, yte) = load_data(seed)
    data = mx.sym.var("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=64, name="fc1"), act_type="relu")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(h, num_hidden=10, name="fc2"), name="softmax")
    mod = gpmx.Module(out, context=ctx, compress_params=TWO_BIT if compress else None)
    train_iter = mx.io.NDArrayIter(xtr, ytr, batch, shuffle=False, last_batch_handle="discard")
    mod.bind(data_shapes=train_iter.provide_data, label_shapes=train_iter.provide_label)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(kvstore=STORE, optimizer="sgd",
                       optimizer_params={"learning_rate": lr, "momentum": 0.9})
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        train_iter.reset()
        for b in train_iter:
            mod.forward_backward(b)
            mod.update()
        mx.nd.waitall()
        times.append(time.perf_counter() - t0)
    test_iter = mx.io.NDArrayIter(xte, yte, batch)
    acc = mod.score(test_iter, "acc")[0][1]
    return acc, mod._kvstore.stats(), float(np.mean(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--api", choices=["trainer", "module"], default="trainer")
    args = parser.parse_args()
    train = train_trainer if args.api == "trainer" else train_module
    print("digits MLP (64-64-10), 2 CPU contexts, SGD lr 0.1 momentum 0.9, %d epochs, %s API"
          % (args.epochs, args.api))
    print("%-26s %9s %14s %14s %12s" % ("compression", "accuracy", "bytes pushed", "saved", "s/epoch"))
    for compress in (False, True):
        acc, stats, per_epoch = train(compress, epochs=args.epochs)
        name = "2bit +-%g" % TWO_BIT["pos_threshold"] if compress else "none"
        print("%-26s %8.2f%% %14d %14d %12.3f" % (
            name, 100 * acc, stats["wire_bytes"], stats["raw_bytes"] - stats["wire_bytes"], per_epoch))


if __name__ == "__main__":
    main()
