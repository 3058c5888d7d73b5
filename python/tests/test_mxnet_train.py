"""Gluon Trainer and Module with compress_params on a real MXNet 1.9.1: exact
weights for the proposal's example, bit-equality with MXNet's own store,
checkpoints, convergence on digits, and clear errors for bad use."""
import os
import subprocess
import sys

import numpy as np
import pytest

from mxnet_required import mxnet

mx = mxnet()
import gradpack  # noqa: E402
import gradpack.mxnet as gpmx  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
TWO_BIT = {"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5}
CTX = [mx.cpu(0), mx.cpu(1)]


def trainer_weights(update_on_kvstore, compress=TWO_BIT, steps=4):
    net = mx.gluon.nn.Dense(1, use_bias=False, in_units=4)
    net.initialize(mx.init.One(), ctx=CTX)
    trainer = gpmx.Trainer(net.collect_params(), "sgd", {"learning_rate": 1.0}, kvstore="device",
                           update_on_kvstore=update_on_kvstore, compress_params=compress)
    seen = []
    for _ in range(steps):
        with mx.autograd.record():
            losses = [net(mx.nd.ones((1, 4), ctx=c)) for c in CTX]
        for l in losses:
            l.backward()
        for g in net.weight.list_grad():
            g[:] = 0.3
        trainer.step(1)
        seen.append(net.weight.data(CTX[1]).asnumpy())
    assert isinstance(trainer._kvstore, gpmx.GradpackStore)
    return seen


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_trainer_two_bit_weights(update_on_kvstore):
    # Each device pushes 0.3 per step: residual 0.3 -> nothing, 0.6 -> sends 0.5,
    # 0.4 -> nothing, 0.7 -> sends 0.5; two devices sum to 1; SGD lr 1.
    seen = trainer_weights(update_on_kvstore)
    assert [w.ravel().tolist() for w in seen] == [[1.0] * 4, [0.0] * 4, [0.0] * 4, [-1.0] * 4]


def module_weights(update_on_kvstore, monkeypatch, compress=TWO_BIT, steps=4):
    monkeypatch.setenv("MXNET_UPDATE_ON_KVSTORE", "1" if update_on_kvstore else "0")
    data = mx.sym.var("data")
    out = mx.sym.MakeLoss(mx.sym.sum(mx.sym.FullyConnected(data, num_hidden=1, no_bias=True, name="fc")))
    mod = gpmx.Module(out, data_names=["data"], label_names=None, context=CTX, compress_params=compress)
    mod.bind(data_shapes=[("data", (2, 4))])
    mod.init_params(mx.init.One())
    mod.init_optimizer(kvstore="device", optimizer="sgd",
                       optimizer_params={"learning_rate": 1.0, "rescale_grad": 1.0})
    assert isinstance(mod._kvstore, gpmx.GradpackStore)
    assert mod._update_on_kvstore == update_on_kvstore
    seen = []
    for _ in range(steps):
        mod.forward_backward(mx.io.DataBatch([mx.nd.ones((2, 4))]))
        for grads in mod._exec_group.grad_arrays:
            for g in grads:
                g[:] = 0.3
        mod.update()
        seen.append(mod.get_params()[0]["fc_weight"].asnumpy())
    return seen


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_module_two_bit_weights(update_on_kvstore, monkeypatch):
    seen = module_weights(update_on_kvstore, monkeypatch)
    assert [w.ravel().tolist() for w in seen] == [[1.0] * 4, [0.0] * 4, [0.0] * 4, [-1.0] * 4]


def mlp_run(trainer_cls, update_on_kvstore, steps=5, optimizer=("sgd", {"learning_rate": 0.1, "momentum": 0.9}),
            kvstore="device"):
    mx.random.seed(1)
    rng = np.random.default_rng(1)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(16, activation="relu", in_units=8), mx.gluon.nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier(), ctx=CTX)
    trainer = trainer_cls(net.collect_params(), optimizer[0], dict(optimizer[1]), kvstore=kvstore,
                          update_on_kvstore=update_on_kvstore)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(steps):
        x = rng.normal(0, 1, (8, 8)).astype(np.float32)
        y = rng.integers(0, 3, 8).astype(np.float32)
        xs = mx.gluon.utils.split_and_load(x, CTX)
        ys = mx.gluon.utils.split_and_load(y, CTX)
        with mx.autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        for l in losses:
            l.backward()
        trainer.step(8)
    return [p.data(CTX[0]).asnumpy() for p in net.collect_params().values()], trainer


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("optimizer", [("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4}),
                                       ("adam", {"learning_rate": 0.01})])
def test_plugin_without_compression_equals_native_bit_for_bit(update_on_kvstore, optimizer):
    # 'gradpack_device' asks for gradpack's store by name ('device' without
    # compression is MXNet's own, see the test below).
    ours, trainer = mlp_run(gpmx.Trainer, update_on_kvstore, optimizer=optimizer, kvstore="gradpack_device")
    assert isinstance(trainer._kvstore, gpmx.GradpackStore)
    native, trainer = mlp_run(mx.gluon.Trainer, update_on_kvstore, optimizer=optimizer)
    assert type(trainer._kvstore).__name__ == "KVStore"
    for a, b in zip(ours, native):
        np.testing.assert_array_equal(a, b)


def dense_and_trainer(in_units, **trainer_args):
    """A seeded Dense(4) on CTX and an SGD-momentum Trainer: the checkpoint tests' model."""
    mx.random.seed(3)
    net = mx.gluon.nn.Dense(4, in_units=in_units)
    net.initialize(mx.init.Xavier(), ctx=CTX)
    tr = gpmx.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, **trainer_args)
    return net, tr


def dense_step(net, tr, seed, loss):
    """One step on a batch of 4 drawn from `seed`, split over CTX."""
    x = np.random.default_rng(seed).normal(0, 1, (4, net.weight.shape[1])).astype(np.float32)
    xs = mx.gluon.utils.split_and_load(x, CTX)
    with mx.autograd.record():
        losses = [loss(net(a)) for a in xs]
    for l in losses:
        l.backward()
    tr.step(4)


def test_trainer_checkpoint_restores_optimizer_state(tmp_path):
    """save_states / load_states through gradpack's store (update_on_kvstore):
    a run resumed from a checkpoint takes exactly the step the original took.
    (Uncompressed: residuals, as in MXNet, are not part of a checkpoint.)"""
    states, params = str(tmp_path / "trainer.states"), str(tmp_path / "net.params")

    def build():
        return dense_and_trainer(5, kvstore="gradpack_device", update_on_kvstore=True, compress_params=None)

    def step(net, tr, seed):
        dense_step(net, tr, seed, lambda y: y.sum())

    net, tr = build()
    step(net, tr, 0)
    step(net, tr, 1)
    tr.save_states(states)
    net.save_parameters(params)
    step(net, tr, 2)
    want = net.weight.data(CTX[0]).asnumpy()
    assert isinstance(tr._kvstore, gpmx.GradpackStore)

    for restore in (True, False):
        net2, tr2 = build()
        step(net2, tr2, 7)  # a different history: other weights and momentum
        net2.load_parameters(params, ctx=CTX)
        if restore:
            tr2.load_states(states)
        step(net2, tr2, 2)
        got = net2.weight.data(CTX[0]).asnumpy()
        if restore:
            np.testing.assert_array_equal(got, want)
            assert tr2._optimizer.momentum == 0.9
        else:
            assert not np.array_equal(got, want)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
@pytest.mark.parametrize("compress", [TWO_BIT, {"compress": "powersgd", "rank": 1},
                                      {"compress": "qsgd_mn", "bits": 2, "seed": 3}])
def test_trainer_checkpoint_resumes_compression_exactly(tmp_path, update_on_kvstore, compress):
    """save_states / load_states carry the residuals and scheme state (with
    the optimizer's): a run resumed after 3 of 6 steps ends bit for bit where
    the uninterrupted run ends, whether the store or the workers update."""
    states, params = str(tmp_path / "t.states"), str(tmp_path / "t.params")

    def build():
        return dense_and_trainer(6, kvstore="device", update_on_kvstore=update_on_kvstore, compress_params=compress)

    def step(net, tr, seed):
        dense_step(net, tr, seed, lambda y: (y ** 2).sum())

    net, tr = build()
    for s in range(6):
        step(net, tr, s)
    want = net.weight.data(CTX[0]).asnumpy()
    net, tr = build()
    for s in range(3):
        step(net, tr, s)
    net.save_parameters(params)
    tr.save_states(states)
    assert isinstance(tr._kvstore, gpmx.GradpackStore) and tr._update_on_kvstore == update_on_kvstore
    for restore in (True, False):
        net2, tr2 = build()
        net2.load_parameters(params, ctx=CTX)
        if restore:
            tr2.load_states(states)
        for s in range(3, 6):
            step(net2, tr2, s)
        got = net2.weight.data(CTX[0]).asnumpy()
        if restore:
            np.testing.assert_array_equal(got, want)
        else:
            assert not np.array_equal(got, want)


def test_module_optimizer_states_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("MXNET_UPDATE_ON_KVSTORE", "1")
    data = mx.sym.var("data")
    out = mx.sym.MakeLoss(mx.sym.sum(mx.sym.FullyConnected(data, num_hidden=2, name="fc")))
    mod = gpmx.Module(out, data_names=["data"], label_names=None, context=CTX)
    mod.bind(data_shapes=[("data", (2, 3))])
    mod.init_params(mx.init.One())
    mod.init_optimizer(kvstore="gradpack_device", optimizer="sgd",
                       optimizer_params={"learning_rate": 0.1, "momentum": 0.9})
    assert isinstance(mod._kvstore, gpmx.GradpackStore)
    mod.forward_backward(mx.io.DataBatch([mx.nd.ones((2, 3))]))
    mod.update()
    path = str(tmp_path / "mod.states")
    mod.save_optimizer_states(path)
    before = mod._kvstore._store.optimizer_states()
    mod.forward_backward(mx.io.DataBatch([mx.nd.ones((2, 3))]))
    mod.update()
    assert mod._kvstore._store.optimizer_states() != before
    mod.load_optimizer_states(path)
    assert mod._kvstore._store.optimizer_states() == before


def test_compress_params_with_one_context_is_an_error():
    net = mx.gluon.nn.Dense(1, in_units=2)
    net.initialize(ctx=mx.cpu(0))
    tr = gpmx.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, compress_params=TWO_BIT)
    with mx.autograd.record():
        l = net(mx.nd.ones((1, 2))).sum()
    l.backward()
    with pytest.raises(gradpack.Error, match="with one context and store 'device' MXNet creates none"):
        tr.step(1)
    data = mx.sym.var("data")
    mod = gpmx.Module(mx.sym.MakeLoss(mx.sym.sum(data)), label_names=None, context=mx.cpu(0),
                      compression_params={"type": "2bit", "threshold": 0.5})
    mod.bind(data_shapes=[("data", (1, 2))])
    mod.init_params()
    with pytest.raises(gradpack.Error, match="compress_params needs a KVStore"):
        mod.init_optimizer(kvstore="device")


def test_bad_compress_params_fail_at_construction():
    net = mx.gluon.nn.Dense(1, in_units=2)
    net.initialize(ctx=CTX)
    with pytest.raises(gradpack.Error, match="'threshhold': unknown key"):
        gpmx.Trainer(net.collect_params(), "sgd", compress_params={"type": "2bit", "threshhold": 0.5})
    with pytest.raises(gradpack.Error, match="unknown compression type 'onebit'"):
        gpmx.Module(mx.sym.var("data"), compress_params={"compress": "onebit"})
    with pytest.raises(gradpack.Error, match="not both"):
        gpmx.Trainer(net.collect_params(), "sgd", compress_params=TWO_BIT, compression_params=TWO_BIT)


def embedding_step(trainer_cls, **kwargs):
    emb = mx.gluon.nn.Embedding(10, 4, sparse_grad=True)
    emb.initialize(mx.init.One(), ctx=CTX)
    tr = trainer_cls(emb.collect_params(), "sgd", {"learning_rate": 0.1}, **kwargs)
    xs = [mx.nd.array([1, 2], ctx=c) for c in CTX]
    with mx.autograd.record():
        losses = [emb(x).sum() for x in xs]
    for l in losses:
        l.backward()
    tr.step(2)
    return emb.weight.data(CTX[0]).asnumpy(), tr


def test_sparse_gradients_with_compression_are_compressed_dense():
    """An Embedding with sparse gradients on 2 contexts with 2-bit: the
    gradients are held dense and compressed (each device's 1.0 sends 0.5,
    summed 1.0, over 2 = 0.5, lr 0.1), untouched rows stay as they were."""
    weights, tr = embedding_step(gpmx.Trainer, compress_params=TWO_BIT)
    assert isinstance(tr._kvstore, gpmx.GradpackStore) and tr._update_on_kvstore is False
    assert (weights[[1, 2]] == np.float32(0.95)).all() and (weights[[0, 3]] == 1).all()


def test_module_sparse_gradients_with_compression_are_compressed_dense():
    """Module with an Embedding's sparse gradients on 2 contexts with 2-bit:
    each device's gradient of 1.0 sends 0.5, summed 1.0, rescaled by 1/2,
    lr 0.1, twice: rows 1 and 2 reach 0.9 (MXNet uncompressed gives 0.8)."""
    data = mx.sym.var("data")
    emb = mx.sym.Embedding(data, input_dim=10, output_dim=4, sparse_grad=True, name="emb")
    mod = gpmx.Module(mx.sym.MakeLoss(mx.sym.sum(emb)), label_names=None, context=CTX, compress_params=TWO_BIT)
    mod.bind(data_shapes=[("data", (2, 2))])
    mod.init_params(mx.init.One())
    mod.init_optimizer(kvstore="device", optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    assert isinstance(mod._kvstore, gpmx.GradpackStore)
    for _ in range(2):
        mod.forward_backward(mx.io.DataBatch([mx.nd.array([[1, 2], [1, 2]])]))
        mod.update()
    w = mod.get_params()[0]["emb_weight"].asnumpy()
    assert (w[[1, 2]] == np.float32(0.9)).all() and (w[[0, 3]] == 1).all(), w


def test_sparse_weights_with_compression_train_as_in_mxnet():
    """A row_sparse weight beside a dense one, 2-bit on: the sparse key lives
    in MXNet's own store (updated there, uncompressed), so its weights equal
    plain MXNet's bit for bit; the dense one is compressed by gradpack."""
    def run(trainer_cls, **kwargs):
        mx.random.seed(0)
        emb = mx.gluon.contrib.nn.SparseEmbedding(10, 4, weight_initializer=mx.init.One())
        dense = mx.gluon.nn.Dense(1, in_units=4, weight_initializer=mx.init.One(), use_bias=False)
        emb.initialize(ctx=CTX)
        dense.initialize(ctx=CTX)
        params = emb.collect_params()
        params.update(dense.collect_params())
        tr = trainer_cls(params, "sgd", {"learning_rate": 0.1}, kvstore="device", **kwargs)
        for step in range(3):
            xs = [mx.nd.array([step, step + 1], ctx=c) for c in CTX]
            with mx.autograd.record():
                # Independent terms: the embedding's gradient does not depend on the dense weight.
                losses = [emb(x).sum() + dense(mx.nd.full((1, 4), 0.3, ctx=x.context)).sum() for x in xs]
            for l in losses:
                l.backward()
            tr.step(2)
        weight = emb.weight.row_sparse_data(mx.nd.arange(10, ctx=CTX[0])).asnumpy()
        return weight, dense.weight.data(CTX[0]).asnumpy(), tr

    ours_emb, ours_w, tr = run(gpmx.Trainer, compress_params=TWO_BIT)
    assert isinstance(tr._kvstore, gpmx.GradpackStore) and tr._update_on_kvstore is True
    plain_emb, plain_w, _ = run(mx.gluon.Trainer)
    np.testing.assert_array_equal(ours_emb, plain_emb)
    assert not np.array_equal(ours_w, plain_w)  # the dense weight's gradients were compressed


@pytest.mark.parametrize("installed", [False, True])
def test_without_compression_trainer_and_module_get_mxnets_own_store(installed):
    """Several contexts, no compression: MXNet's own store and results, sparse
    parameters included, whether or not install() patched mx.kv.create."""
    if installed:
        gpmx.install()
    try:
        ours, tr = embedding_step(gpmx.Trainer)
        assert type(tr._kvstore) is mx.kvstore.KVStore and tr._kvstore.type == "device"
        native, _ = embedding_step(mx.gluon.Trainer)
        np.testing.assert_array_equal(ours, native)
        assert (ours[1] == np.float32(0.9)).all() and (ours[0] == 1).all()  # rows 1, 2 stepped
        data = mx.sym.var("data")
        mod = gpmx.Module(mx.sym.MakeLoss(mx.sym.sum(mx.sym.FullyConnected(data, num_hidden=1, name="fc"))),
                          label_names=None, context=CTX)
        mod.bind(data_shapes=[("data", (2, 3))])
        mod.init_params()
        mod.init_optimizer(kvstore="local")
        assert type(mod._kvstore) is mx.kvstore.KVStore and mod._kvstore.type == "local"
        # A user's own mx.kv.create after install() is still gradpack's.
        assert isinstance(mx.kv.create("device"), gpmx.GradpackStore) == installed
    finally:
        gpmx.uninstall()


def test_proposal_example_runs_after_install():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "proposal_usage.py")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "proposal example: ok" in out.stdout


@pytest.mark.parametrize("api", ["trainer", "module"])
def test_digits_convergence_with_and_without_compression(api):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import train_digits
    finally:
        sys.path.pop(0)
    train = train_digits.train_trainer if api == "trainer" else train_digits.train_module
    plain, plain_stats, _ = train(False, epochs=10)
    packed, packed_stats, _ = train(True, epochs=10)
    print("\ndigits MLP via %s: accuracy %.2f%% uncompressed, %.2f%% with 2-bit (threshold %s)"
          % (api, 100 * plain, 100 * packed, train_digits.TWO_BIT["pos_threshold"]))
    assert plain > 0.95
    assert packed >= plain - 0.02
    assert plain_stats["wire_bytes"] == plain_stats["raw_bytes"]
    assert packed_stats["raw_bytes"] >= 14 * packed_stats["wire_bytes"]
