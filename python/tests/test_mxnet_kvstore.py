"""gradpack's KVStore plugins inside MXNet 1.9.1: registration, zero-copy
NDArrays, install()/uninstall(), MXNet optimizers, clear errors."""
import numpy as np
import pytest

from mxnet_required import mxnet

mx = mxnet()
import gradpack  # noqa: E402
import gradpack.mxnet as gpmx  # noqa: E402

TWO_BIT = {"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5}


@pytest.fixture
def installed():
    gpmx.install()
    yield
    gpmx.uninstall()


def test_import_registers_plugins_and_changes_nothing_else():
    assert not gpmx.installed()
    kv = mx.kv.create("gradpack_device")
    assert isinstance(kv, gpmx.GradpackStore) and kv.type == "device"
    assert isinstance(mx.kv.create("gradpack_local"), gpmx.GradpackStore)
    native = mx.kv.create("device")
    assert type(native).__name__ == "KVStore" and not hasattr(native, "set_compress")
    assert mx.gluon.Trainer is not gpmx.Trainer and mx.mod.Module is not gpmx.Module


def test_install_routes_the_proposal_api(installed):
    kv = mx.kv.create("device")
    assert isinstance(kv, gpmx.GradpackStore)
    kv.set_compress(TWO_BIT)
    kv.init(3, mx.nd.zeros((2, 3)))
    for _ in range(2):
        kv.push(3, [mx.nd.full((2, 3), 0.3, ctx=mx.cpu(i)) for i in range(2)])
    out = [mx.nd.zeros((2, 3), ctx=mx.cpu(i)) for i in range(2)]
    kv.pull(3, out=out)
    assert all((o.asnumpy() == 1.0).all() for o in out)  # 0.6 per device -> 0.5 each
    assert mx.mod.Module is gpmx.Module and mx.gluon.Trainer is gpmx.Trainer
    assert mx.kvstore.create is gpmx.create
    gpmx.uninstall()
    assert type(mx.kv.create("device")).__name__ == "KVStore"
    gpmx.install()


def test_local_store_refuses_compression(installed):
    with pytest.raises(gradpack.Error, match="create a 'device' store"):
        mx.kv.create("local").set_compress(TWO_BIT)


def test_names_gradpack_does_not_serve_are_mxnets(installed):
    """local_allreduce_cpu and friends, and a user's KVStoreBase plugin, go to
    MXNet's own create unchanged."""
    for name in ("local_allreduce_cpu", "local_update_cpu", "local_allreduce_device"):
        kv = mx.kv.create(name)
        assert type(kv).__name__ == "KVStore" and kv.type == name
        kv.init(0, mx.nd.ones((2,)))
        kv.push(0, [mx.nd.ones((2,)) * 2, mx.nd.ones((2,)) * 3])
        out = mx.nd.zeros((2,))
        kv.pull(0, out=out)
        assert out.asnumpy().tolist() == [5.0, 5.0]

    class UsersStore(mx.kv.KVStoreBase):
        pass
    mx.kv.KVStoreBase.register(UsersStore)
    assert type(mx.kv.create("usersstore")) is UsersStore
    # Whatever MXNet makes of a name it does not know either (a local store), unchanged.
    assert type(mx.kv.create("no_such_store")).__name__ == "KVStore"


def test_store_errors_are_mxnet_errors_too(installed):
    kv = mx.kv.create("device")
    kv.init(0, mx.nd.zeros((4,)))
    for call in (lambda: kv.push(0, mx.nd.zeros(3)), lambda: kv.set_compress({"compress": "4bit"}),
                 lambda: mx.kv.create("local").set_compress(TWO_BIT)):
        with pytest.raises(mx.base.MXNetError) as info:
            call()
        assert isinstance(info.value, gradpack.Error) and isinstance(info.value, gpmx.KVStoreError)


def test_set_updater_is_mxnets_private_name_too(installed):
    kv = mx.kv.create("device")
    kv.init("w", mx.nd.ones((3,)))
    seen = []

    def updater(key, grad, weight):
        seen.append(key)
        weight[:] += 2 * grad
    kv._set_updater(updater)
    kv.push("w", [mx.nd.ones((3,)), mx.nd.ones((3,))])  # merged 2: 1 + 2 * 2
    out = mx.nd.zeros((3,))
    kv.pull("w", out=out)
    assert out.asnumpy().tolist() == [5.0] * 3 and seen == ["w"]


def test_multi_precision_on_float32_is_a_no_op(installed):
    """MXNet ignores multi_precision for float32 weights; so does gradpack,
    which runs SGD itself (it used to refuse it, naming SGD as unsupported)."""
    kv = mx.kv.create("device")
    kv.init(0, mx.nd.ones((3,)))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, multi_precision=True))
    assert kv._rust
    kv.push(0, [mx.nd.ones((3,))])
    out = mx.nd.zeros((3,))
    kv.pull(0, out=out)
    assert out.asnumpy().tolist() == [0.5] * 3  # 1 - 0.5 * 1


def test_results_are_ordered_with_mxnet_engine():
    # The pushed value comes from pending MXNet ops; the pulled value feeds more ops.
    kv = mx.kv.create("gradpack_device")
    kv.init("w", mx.nd.zeros(1000))
    a = mx.nd.ones(1000)
    for _ in range(20):
        a = a * 1.1
    kv.push("w", [a, a])
    out = mx.nd.zeros(1000)
    kv.pull("w", out=out)
    doubled = out * 2
    np.testing.assert_allclose(doubled.asnumpy(), 4 * 1.1 ** 20, rtol=1e-5)


def test_pushpull_in_place_and_broadcast():
    kv = mx.kv.create("gradpack_device")
    value = mx.nd.arange(6).reshape((2, 3))
    outs = [mx.nd.zeros((2, 3), ctx=mx.cpu(i)) for i in range(2)]
    kv.broadcast(0, value, outs)
    assert all((o.asnumpy() == value.asnumpy()).all() for o in outs)
    grads = [mx.nd.ones((2, 3)), mx.nd.full((2, 3), 2)]
    kv.pushpull(0, grads)
    assert all((g.asnumpy() == 3).all() for g in grads)


@pytest.mark.parametrize("optimizer", [
    mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3, rescale_grad=0.5),
    mx.optimizer.NAG(learning_rate=0.1, momentum=0.9),
    mx.optimizer.Adam(learning_rate=0.01),
    mx.optimizer.RMSProp(learning_rate=0.01),  # not in Rust: MXNet's updater runs locally
])
def test_set_optimizer_equals_native_store(optimizer):
    import copy
    rng = np.random.default_rng(0)
    w0 = rng.normal(0, 1, (5, 7)).astype(np.float32)
    grads = [[rng.normal(0, 1, (5, 7)).astype(np.float32) for _ in range(2)] for _ in range(4)]
    results = []
    for store in (mx.kv.create("gradpack_device"), mx.kv.create("device")):
        store.set_optimizer(copy.deepcopy(optimizer))
        store.init("w", mx.nd.array(w0))
        out = mx.nd.zeros((5, 7))
        for g in grads:
            store.pushpull("w", [mx.nd.array(x) for x in g], out=out)
        results.append(out.asnumpy())
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("store", ["device", "local"])
@pytest.mark.parametrize("optimizer", [
    None,
    mx.optimizer.SGD(learning_rate=1.0),
    mx.optimizer.SGD(learning_rate=1.0, multi_precision=True),
    mx.optimizer.SGD(learning_rate=0.5, momentum=0.9, multi_precision=True),
    mx.optimizer.Adam(learning_rate=0.01, multi_precision=True),
    mx.optimizer.RMSProp(learning_rate=0.01, multi_precision=True),  # MXNet's updater, float16 NDArrays
])
def test_float16_values_equal_mxnets_own_store(store, optimizer):
    """float16 keys, bit for bit against MXNet's store of the same name:
    without an optimizer the sum of 3 devices (2048 + 1 + 1 rounds per add on
    'device', once on 'local'); with one, 10 small steps, in float16 or, with
    multi_precision, on a float32 master copy."""
    import copy
    results = []
    for kv in (gpmx.GradpackStore(store), mx.kv.create(store)):
        kv.init(3, mx.nd.ones((2, 3), dtype="float16"))
        if optimizer is None:
            kv.push(3, [mx.nd.full((2, 3), 2048, dtype="float16")] + [mx.nd.ones((2, 3), dtype="float16")] * 2)
        else:
            kv.set_optimizer(copy.deepcopy(optimizer))
            for i in range(10):
                kv.push(3, [mx.nd.full((2, 3), 1e-4 * (i + 1), dtype="float16")] * 2)
        out = mx.nd.zeros((2, 3), dtype="float16")
        kv.pull(3, out=out)
        assert out.dtype == np.float16
        results.append(out.asnumpy())
    np.testing.assert_array_equal(results[0], results[1])
    if optimizer is None:
        assert results[0][0, 0] == (2048 if store == "device" else 2050)


def test_sparse_keys_are_served_by_mxnets_own_store_beside_compressed_dense_keys(installed):
    """A key initialized with a row_sparse value lives in MXNet's own store of
    the same type, uncompressed (MXNet compresses dense arrays only), so
    push, pull and row_sparse_pull behave exactly as MXNet's; dense keys of
    the same store are gradpack's and compressed."""
    mxnet_create = __import__("gradpack.mxnet", fromlist=["_saved"])._saved[(mx.kv, "create")]
    shape = (6, 3)

    def run(kv, compress):
        if compress:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, wd=0.1))
        kv.init("emb", mx.nd.ones(shape).tostype("row_sparse"))
        kv.init("dense", mx.nd.ones(shape))
        rows = []
        for step in range(3):
            g = mx.nd.zeros(shape)
            g[step] = step + 1
            kv.push("emb", [g.tostype("row_sparse"), g.tostype("row_sparse")])
            out = mx.nd.sparse.zeros("row_sparse", shape)
            kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([0, step, 5]))
            rows.append(out.asnumpy())
            kv.push("dense", [mx.nd.full(shape, 0.3)] * 2)
        dense = mx.nd.zeros(shape)
        kv.pull("dense", out=dense)
        return rows, dense.asnumpy()

    ours_rows, ours_dense = run(mx.kv.create("device"), compress=True)
    want_rows, _ = run(mxnet_create("device"), compress=False)
    for got, want in zip(ours_rows, want_rows):
        np.testing.assert_array_equal(got, want)
    # The same store uncompressed: the same sparse rows, another dense result.
    plain_rows, plain_dense = run(gpmx.GradpackStore("device"), compress=False)
    assert not np.array_equal(ours_dense, plain_dense)  # the dense key was compressed
    for got, want in zip(plain_rows, want_rows):
        np.testing.assert_array_equal(got, want)


def test_pull_into_sparse_outputs_follows_ignore_sparse(installed):
    kv = mx.kv.create("local")
    kv.init("w", mx.nd.ones((2, 2)))
    out = mx.nd.sparse.zeros("row_sparse", (2, 2))
    with pytest.warns(UserWarning, match="sparse outputs of pull are ignored"):
        kv.pull("w", out=out)
    assert out.asnumpy().sum() == 0
    kv.pull("w", out=out, ignore_sparse=False)  # the value, as row_sparse (how Trainer pulls sparse gradients)
    assert out.stype == "row_sparse" and out.asnumpy().tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_bad_use_is_refused_clearly():
    kv = mx.kv.create("gradpack_device")
    kv.init(0, mx.nd.zeros((4, 4)))
    with pytest.raises(gradpack.Error, match="row_sparse_pull needs a key initialized with a row_sparse value"):
        kv.row_sparse_pull(0, out=mx.nd.zeros((4, 4)), row_ids=mx.nd.array([0]))
    with pytest.raises(gradpack.Error, match="'bits': unknown key"):
        kv.set_compress({"compress": "2bit", "threshold": 0.5, "bits": 2})
    with pytest.raises(gradpack.Error, match="key 0: pushed value 0 has shape \\[3\\]"):
        kv.push(0, mx.nd.zeros(3))
    with pytest.raises(gradpack.Error, match="unknown capability"):
        kv.is_capable("teleport")


def test_a_store_refuses_copies_and_pickling_and_works_on():
    """Run apart: a copy sharing the native store would free it twice."""
    import subprocess
    import sys
    code = """
import copy, gc, pickle
import mxnet as mx
import gradpack, gradpack.mxnet as gpmx
kv = mx.kv.create("gradpack_device")
kv.init(3, mx.nd.zeros((2, 3)))
for f in (copy.copy, copy.deepcopy, pickle.dumps):
    try:
        f(kv)
    except gradpack.Error as e:
        assert str(e).startswith("a gradpack.mxnet.GradpackStore ('device') cannot be "), e
        assert "load_compression_states()" in str(e), e
    else:
        raise AssertionError("%s was not refused" % f.__name__)
kv.push(3, mx.nd.ones((2, 3)))
out = mx.nd.zeros((2, 3))
kv.pull(3, out=out)
assert out.asnumpy().tolist() == [[1.0] * 3] * 2, out
del kv
gc.collect()
print("done")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.endswith("done\n"), (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
