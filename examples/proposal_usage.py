"""The usage section of MXNet's 2-bit compression proposal, verbatim MXNet API,
running on gradpack after one explicit line: gradpack.mxnet.install().

Run: python examples/proposal_usage.py"""
import numpy as np

import mxnet as mx
import gradpack.mxnet

gradpack.mxnet.install()  # the one line this script adds to the proposal's usage

# --- the operators -------------------------------------------------------
grad = mx.nd.array([0, 2.5, 1, -3, 2, 0.5, -1, -2])
residual = mx.nd.zeros(grad.shape)
compr = mx.nd.contrib.create_2bit(grad)
mx.nd.contrib.quantize_2bit(grad, residual, compr, -2.0, 2.0)
decompr = mx.nd.zeros(grad.shape)
mx.nd.contrib.dequantize_2bit(compr, decompr)
print("compressed:", compr.asnumpy(), "residual:", residual.asnumpy(), "decompressed:", decompr.asnumpy())
assert compr.asnumpy().view(np.uint32)[3] == 0x12420000

# --- a KVStore with compression ------------------------------------------
kv = mx.kv.create("device")
kv.set_compress({"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
shape = (2, 3)
kv.init(3, mx.nd.ones(shape))
kv.push(3, [mx.nd.ones(shape, ctx=mx.cpu(i)) * 0.6 for i in range(2)])
out = [mx.nd.zeros(shape, ctx=mx.cpu(i)) for i in range(2)]
kv.pull(3, out=out)
print("kvstore pulled:", out[0].asnumpy().ravel())
assert (out[0].asnumpy() == 1.0).all()  # each device sent 0.5, kept 0.1

# --- Module ----------------------------------------------------------------
data = mx.sym.var("data")
net = mx.sym.FullyConnected(data, num_hidden=4, name="fc")
net = mx.sym.SoftmaxOutput(net, name="softmax")
mod = mx.mod.Module(net, context=[mx.cpu(0), mx.cpu(1)],
                    compress_params={"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
x = np.random.default_rng(0).normal(0, 1, (64, 10)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.float32)
mod.fit(mx.io.NDArrayIter(x, y, batch_size=16), num_epoch=2, kvstore="device",
        optimizer="sgd", optimizer_params={"learning_rate": 0.1})
print("Module trained with", type(mod._kvstore).__name__, mod._kvstore.stats())

# --- Gluon Trainer -----------------------------------------------------------
ctx = [mx.cpu(0), mx.cpu(1)]
dense = mx.gluon.nn.Dense(4)
dense.initialize(ctx=ctx)
trainer = mx.gluon.Trainer(dense.collect_params(), "sgd", {"learning_rate": 0.1},
                           compress_params={"compress": "2bit", "pos_threshold": 0.5,
                                            "neg_threshold": -0.5})
for xb in mx.gluon.utils.split_and_load(x[:16], ctx):
    with mx.autograd.record():
        loss = dense(xb).sum()
    loss.backward()
trainer.step(16)
print("Trainer stepped with", type(trainer._kvstore).__name__, trainer._kvstore.stats())
print("proposal example: ok")
