"""A worker of test_dist_mxnet.py and test_allreduce.py: a Gluon Trainer or a
Module on a dist_sync (or argv[3]) gradpack store with 2-bit compression, one
context per worker; every gradient is 0.3 before each update; writes the
weights after each step. GRADPACK_TEST_OPTIMIZER=pysgd trains with a Python
subclass of SGD, which gradpack's servers cannot run."""
import json
import os
import sys

import mxnet as mx
import gradpack.mxnet as gpmx

api, update_on_kvstore = sys.argv[1], {"1": True, "0": False, "none": None}[sys.argv[2]]
store_type = sys.argv[3] if len(sys.argv) > 3 else "dist_sync"
TWO_BIT = {"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5}
if os.environ.get("GRADPACK_TEST_PARAMS"):
    TWO_BIT = json.loads(os.environ["GRADPACK_TEST_PARAMS"])
OPTIMIZER = os.environ.get("GRADPACK_TEST_OPTIMIZER", "sgd")


@mx.optimizer.register
class PySGD(mx.optimizer.SGD):
    """SGD's update rule under another class: not one the servers run."""


seen = []
if api == "trainer":
    net = mx.gluon.nn.Dense(1, use_bias=False, in_units=4)
    net.initialize(mx.init.One(), ctx=mx.cpu(0))
    trainer = gpmx.Trainer(net.collect_params(), OPTIMIZER, {"learning_rate": 1.0}, kvstore=store_type,
                           update_on_kvstore=update_on_kvstore, compress_params=TWO_BIT)
    for _ in range(4):
        with mx.autograd.record():
            loss = net(mx.nd.ones((1, 4)))
        loss.backward()
        net.weight.grad()[:] = 0.3
        trainer.step(1)
        seen.append(net.weight.data().asnumpy().ravel().tolist())
    rank, store, updated_on_kvstore = trainer._kvstore.rank, trainer._kvstore, trainer._update_on_kvstore
else:
    os.environ["MXNET_UPDATE_ON_KVSTORE"] = "0" if update_on_kvstore is False else "1"
    data = mx.sym.var("data")
    out = mx.sym.MakeLoss(mx.sym.sum(mx.sym.FullyConnected(data, num_hidden=1, no_bias=True, name="fc")))
    mod = gpmx.Module(out, data_names=["data"], label_names=None, context=mx.cpu(0), compress_params=TWO_BIT)
    mod.bind(data_shapes=[("data", (1, 4))])
    mod.init_params(mx.init.One())
    mod.init_optimizer(kvstore=store_type, optimizer=OPTIMIZER,
                       optimizer_params={"learning_rate": 1.0, "rescale_grad": 1.0})
    for _ in range(4):
        mod.forward_backward(mx.io.DataBatch([mx.nd.ones((1, 4))]))
        for grads in mod._exec_group.grad_arrays:
            for g in grads:
                g[:] = 0.3
        mod.update()
        seen.append(mod.get_params()[0]["fc_weight"].asnumpy().ravel().tolist())
    rank, store, updated_on_kvstore = mod._kvstore.rank, mod._kvstore, mod._update_on_kvstore
assert isinstance(store, gpmx.GradpackStore) and store.type == store_type
with open(os.path.join(os.environ["GRADPACK_TEST_OUT"], "rank%d.json" % rank), "w") as f:
    json.dump({"weights": seen, "stats": store.stats(), "update_on_kvstore": updated_on_kvstore,
               "worker_updates": store._worker_updater is not None}, f)
