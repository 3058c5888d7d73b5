"""gradpack.kv: MXNet's KVStore semantics with exact values, 2-bit compression
against a numpy model of per-device residuals, optimizers against MXNet's own
update operators, and bad input leaving state untouched."""
import math
import os
import threading

import numpy as np
import pytest

import gradpack
import numpy_2bit

SHAPE = (4, 4)
TWO_BIT = {"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5}


def full(v, shape=SHAPE, dtype=np.float32):
    return np.full(shape, v, dtype)


def pulled(kv, key, shape=SHAPE):
    out = np.full(shape, np.nan, np.float32)
    kv.pull(key, out=out)
    return out


@pytest.mark.parametrize("name", ["local", "device"])
def test_sum_over_devices_and_updater(name):
    kv = gradpack.kv.create(name)
    assert kv.type == name and kv.rank == 0 and kv.num_workers == 1
    kv.init(3, full(1))
    kv.push(3, [full(d + 1) for d in range(4)])
    outs = [np.zeros(SHAPE, np.float32) for _ in range(3)]
    kv.pull(3, out=outs)
    for o in outs:
        assert (o == 10).all()
    calls = []

    def updater(key, merged, stored):
        calls.append(key)
        stored += 2 * merged
    kv.set_updater(updater)
    for _ in range(4):
        kv.push(3, [full(1)] * 4)
    assert calls == [3] * 4
    assert (pulled(kv, 3) == 10 + 4 * 8).all()


@pytest.mark.parametrize("name,want", [("device", 2048.0), ("local", 2050.0)])
def test_float16_keys(name, want):
    """A float16 init makes a float16 key: float16 pushes (float32 refused
    without compression), sums as MXNet's store of that name keeps them,
    pulls into float16 or float32 outputs; the SGD master copy with
    multi_precision."""
    kv = gradpack.kv.create(name)
    kv.init("h", full(1, dtype=np.float16))
    kv.push("h", [full(2048, dtype=np.float16), full(1, dtype=np.float16), full(1, dtype=np.float16)])
    out16, out32 = full(0, dtype=np.float16), full(0)
    kv.pull("h", out=[out16, out32])
    assert (out16 == want).all() and (out32 == want).all()
    with pytest.raises(gradpack.Error, match="pushed value 0 has dtype float32; without compression values "
                                            "must have the key's dtype, float16"):
        kv.push("h", full(1))
    kv = gradpack.kv.create(name)
    kv.set_optimizer("sgd", learning_rate=1.0, multi_precision=True)
    kv.init(0, full(1, dtype=np.float16))
    for _ in range(10):
        kv.push(0, full(1e-4, dtype=np.float16))
    kv.pull(0, out=out16)
    assert (out16 == np.float16(1 - 10 * np.float32(np.float16(1e-4)))).all()


def test_store_types_come_from_the_rust_table():
    assert gradpack.kv.STORE_TYPES == ("local", "device", "dist_sync_allreduce", "dist_sync", "dist_async",
                                       "dist_sync_device", "dist_device_sync")
    assert gradpack.kv.DIST_TYPES == gradpack.kv.STORE_TYPES[3:]
    assert gradpack.kv.ALLREDUCE_TYPE == "dist_sync_allreduce"
    for name in ("local", "device"):
        assert gradpack.kv.create(name).type == name
    with pytest.raises(gradpack.Error, match="unknown KVStore type 'nccl'"):
        gradpack.kv.create("nccl")


def test_lists_of_keys_and_str_keys():
    kv = gradpack.kv.create("device")
    keys = ["w0", "w1", "w2"]
    kv.init(keys, [full(i) for i in range(3)])
    kv.push(keys, [[full(1), full(2)], full(5), [full(i) for i in range(4)]])
    outs = [np.zeros(SHAPE, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    assert [o[0, 0] for o in outs] == [3, 5, 6]
    # a repeated key in one call groups its values, as MXNet does
    kv.push(["w0", "w0"], [full(1), full(2)])
    assert (pulled(kv, "w0") == 3).all()
    ints = gradpack.kv.create("local")
    ints.init([0, np.int64(1)], [full(0), full(0)])
    with pytest.raises(gradpack.Error, match="cannot be mixed"):
        ints.init("x", full(0))
    with pytest.raises(gradpack.Error, match="key 7: this store uses string keys"):
        kv.pull(7, out=full(0))


def test_pushpull_in_place_and_with_out_and_broadcast():
    kv = gradpack.kv.create("device")
    kv.init(0, full(0))
    a, b = full(1), full(2)
    kv.pushpull(0, [a, b])
    assert (a == 3).all() and (b == 3).all()
    out = [np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)]
    kv.pushpull(0, [full(4), full(4)], out=out)
    assert (out[0] == 8).all() and (out[1] == 8).all()
    outs = [np.zeros((2, 3), np.float32) for _ in range(2)]
    kv2 = gradpack.kv.create("device")
    kv2.broadcast(5, np.arange(6, dtype=np.float32).reshape(2, 3), out=outs)
    for o in outs:
        assert o.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_two_bit_mxnet_cases_on_four_devices():
    kv = gradpack.kv.create("device")
    kv.set_compress(TWO_BIT)
    kv.init(9, full(0.7))
    assert (pulled(kv, 9) == np.float32(0.7)).all(), "init is lossless"
    d = 4
    for value, want in [(0.0, 0.0), (0.4, 0.0), (0.2, 0.5 * d), (0.2, 0.0), (0.2, 0.5 * d)]:
        kv.push(9, [full(value)] * d)
        assert (pulled(kv, 9) == want).all(), (value, want)
    # with an updater the values accumulate
    kv.set_updater(lambda key, merged, stored: stored.__iadd__(2 * merged))
    kv.init(10, full(1))
    kv.push(10, [full(0.4)] * d)
    assert (pulled(kv, 10) == 1).all()
    kv.push(10, [full(0.2)] * d)
    assert (pulled(kv, 10) == 1 + 2 * 0.5 * d).all()
    kv.init(11, full(10))
    for i in range(1, 4):
        kv.push(11, [full(-0.5)] * d)
        assert (pulled(kv, 11) == 10 - 4 * i).all()


@pytest.mark.parametrize("params,neg,pos", [
    (TWO_BIT, -0.5, 0.5),
    ({"compress": "2bit", "pos_threshold": "1.0", "neg_threshold": "-0.25"}, -0.25, 1.0),
    ({"type": "2bit", "threshold": 0.5}, -0.5, 0.5),
])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_random_gradients_match_numpy_model(params, neg, pos, dtype):
    if dtype == "bfloat16":
        import ml_dtypes  # installed by the set-up: missing fails, never skips
        dtype = ml_dtypes.bfloat16
    rng = np.random.default_rng(1)
    devices, shape = 3, (70, 3)
    kv = gradpack.kv.create("device")
    if "type" in params:
        kv.set_gradient_compression(params)
    else:
        kv.set_compress(params)
    kv.init("w", np.zeros(shape, np.float32))
    residuals = [np.zeros(shape[0] * shape[1], np.float32) for _ in range(devices)]
    for _ in range(5):
        grads = [rng.uniform(-0.6, 0.6, shape).astype(np.float32).astype(dtype) for _ in range(devices)]
        kv.push("w", grads)
        want = None
        for i, g in enumerate(grads):
            compr, residuals[i] = numpy_2bit.quantize(g.reshape(-1), residuals[i], neg, pos)
            dec = numpy_2bit.dequantize(compr, g.size)
            want = dec if want is None else want + dec
        np.testing.assert_array_equal(pulled(kv, "w", shape), want.reshape(shape))


def test_local_store_refuses_compression():
    kv = gradpack.kv.create("local")
    with pytest.raises(gradpack.Error, match="create a 'device' store"):
        kv.set_compress(TWO_BIT)
    kv.set_compress({"compress": "none"})


@pytest.mark.parametrize("params,msg", [
    ({"compress": "2bit", "pos_threshold": 0.5}, "'neg_threshold': missing"),
    ({"compress": "2bit", "pos_threshold": "abc", "neg_threshold": -0.5}, "'pos_threshold': must be a number"),
    ({"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": 0.5}, "'neg_threshold': must be finite and < 0"),
    ({"compress": "4bit"}, "unknown compression type '4bit'"),
    ({"compress": "2bit", "threshold": 0.5, "bits": 3}, "'bits': unknown key"),
    ({"type": "2bit"}, "'pos_threshold': missing"),
    ("2bit", "must be a dict"),
])
def test_invalid_compression_params(params, msg):
    kv = gradpack.kv.create("device")
    kv.set_compress(TWO_BIT)
    kv.init(0, full(0))
    kv.push(0, [full(0.3)] * 2)
    with pytest.raises(gradpack.Error, match=msg):
        kv.set_compress(params)
    # the previous setting (and the residuals) survive
    kv.push(0, [full(0.3)] * 2)
    assert (pulled(kv, 0) == 1.0).all()


def test_bad_input_names_key_and_leaves_state():
    kv = gradpack.kv.create("device")
    kv.set_compress(TWO_BIT)
    with pytest.raises(gradpack.Error, match="key 5: not initialized"):
        kv.push(5, full(1))
    with pytest.raises(gradpack.Error, match="key 5: not initialized"):
        kv.pull(5, out=full(0))
    kv.init(5, full(0))
    kv.push(5, [full(0.3)] * 2)  # residuals 0.3, stored 0
    out = full(7)
    bad = [
        (lambda: kv.push(5, [full(1), full(1, (16,))]), "key 5: pushed value 1 has shape \\[16\\], expected \\[4, 4\\]"),
        (lambda: kv.push(5, [full(1), full(1, dtype=np.float64)]), "key 5: pushed value 1 has dtype float64"),
        (lambda: kv.push(5, [full(1), [1.0]]), "key 5: pushed value 1 must be a numpy.ndarray"),
        (lambda: kv.push(5, []), "key 5: push of an empty list"),
        (lambda: kv.init(5, full(0)), "key 5: already initialized"),
        (lambda: kv.pull(5, out=[out, full(0, (2, 8))]), "key 5: pull output 1 has shape \\[2, 8\\]"),
        (lambda: kv.pull(5, out=full(0, dtype=np.float64)), "key 5: pull output 0 has dtype float64"),
        (lambda: kv.pull(5, out=np.zeros((4, 8), np.float32)[:, ::2]), "C-contiguous"),
        (lambda: kv.push([5, 6], [full(1)]), "2 keys need a list of 2 values, got 1"),
        (lambda: kv.push(2.5, full(1)), "keys must be int or str"),
        (lambda: kv.pull(5), "pull needs out="),
    ]
    for call, msg in bad:
        with pytest.raises(gradpack.Error, match=msg):
            call()
    assert (out == 7).all()
    kv.push(5, [full(0.2)] * 2)  # residuals would be 0.5 only if untouched
    assert (pulled(kv, 5) == 1.0).all()


def test_updater_exception_propagates():
    kv = gradpack.kv.create("local")
    kv.init(0, full(1))

    def broken(key, merged, stored):
        raise KeyError("boom %s" % key)
    kv.set_updater(broken)
    with pytest.raises(KeyError, match="boom 0"):
        kv.push(0, full(1))


@pytest.mark.parametrize("name,params", [("sgd", {"momentum": 0.9}), ("nag", {"momentum": 0.8}),
                                         ("adam", {"beta1": 0.8})])
def test_optimizer_states_save_and_load(tmp_path, name, params):
    path = str(tmp_path / "states")
    a = gradpack.kv.create("device")
    a.set_optimizer(name, learning_rate=0.1, **params)
    a.init(0, full(1))
    a.push(0, [full(0.5)] * 2)
    a.save_optimizer_states(path)
    w1 = pulled(a, 0)
    a.push(0, [full(0.25)] * 2)
    w2 = pulled(a, 0)
    # A new store from the saved weights and states takes the very same step.
    b = gradpack.kv.create("device")
    b.set_optimizer(name, learning_rate=0.1, **params)
    b.init(0, w1)
    b.load_optimizer_states(path)
    b.push(0, [full(0.25)] * 2)
    np.testing.assert_array_equal(pulled(b, 0), w2)
    # without the states it would not (momentum / moments start at zero)
    c = gradpack.kv.create("device")
    c.set_optimizer(name, learning_rate=0.1, **params)
    c.init(0, w1)
    c.push(0, [full(0.25)] * 2)
    assert not np.array_equal(pulled(c, 0), w2)
    with open(path, "wb") as f:
        f.write(b"garbage")
    with pytest.raises(gradpack.Error, match="optimizer states"):
        b.load_optimizer_states(path)
    with pytest.raises(gradpack.Error, match="no gradpack optimizer"):
        gradpack.kv.create("local").save_optimizer_states(path)


def test_compression_states_resume_and_refuse_what_does_not_fit(tmp_path):
    """A device store's residuals in a checkpoint: restored, the next push
    sends what the original's would; another threshold is refused by name and
    changes nothing. optimizer_states() carries them too."""
    def store(th=0.5):
        kv = gradpack.kv.create("device")
        kv.set_compress({"compress": "2bit", "threshold": th})
        kv.init("w", full(0))
        return kv
    a = store()
    a.push("w", [full(0.3), full(0.4)])  # residuals 0.3 and 0.4, nothing sent
    blob = a.compression_states()
    b = store()
    b.set_compression_states(blob)
    b.push("w", [full(0.3), full(0.4)])
    np.testing.assert_array_equal(pulled(b, "w"), full(1.0))  # both reach 0.5 now
    c = store()
    c.push("w", [full(0.3), full(0.4)])
    np.testing.assert_array_equal(pulled(c, "w"), full(0))
    other = store(0.7)
    before = other.compression_states()
    with pytest.raises(gradpack.Error, match="compression states: saved with .*0.5.*this store uses .*0.7"):
        other.set_compression_states(blob)
    assert other.compression_states() == before
    d = store()
    d.set_optimizer_states(a.optimizer_states())  # the container: no optimizer, compression states
    d.push("w", [full(0.3), full(0.4)])
    np.testing.assert_array_equal(pulled(d, "w"), full(1.0))


def test_bad_optimizer():
    kv = gradpack.kv.create("device")
    with pytest.raises(gradpack.Error, match="unknown optimizer 'rmsprop'"):
        kv.set_optimizer("rmsprop")
    with pytest.raises(gradpack.Error, match="'beta1': unknown parameter for optimizer 'sgd'"):
        kv.set_optimizer("sgd", beta1=0.9)


def test_pushes_from_threads():
    kv = gradpack.kv.create("device")
    kv.set_compress(TWO_BIT)
    n = 200_000
    keys = list(range(4))
    kv.init(keys, [np.zeros(n, np.float32) for _ in keys])
    errors = []

    def worker(k):
        try:
            for _ in range(3):
                kv.push(k, [np.full(n, 0.5, np.float32)] * 2)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in keys:
        out = np.zeros(n, np.float32)
        kv.pull(k, out=out)
        assert (out == 1.0).all()


OPTIMIZER_CASES = [
    ("sgd", dict(learning_rate=0.1, wd=0.01)),
    ("sgd", dict(learning_rate=0.1, wd=0.01, rescale_grad=0.5, clip_gradient=0.3)),
    ("sgd", dict(learning_rate=0.05, momentum=0.9, wd=0.001)),
    ("sgd", dict(learning_rate=0.05, momentum=0.9, clip_gradient=0.2, rescale_grad=0.25)),
    ("nag", dict(learning_rate=0.05, momentum=0.9, wd=0.001)),
    ("nag", dict(learning_rate=0.05, momentum=0.7, clip_gradient=0.2)),
    ("adam", dict(learning_rate=0.01, wd=0.001)),
    ("adam", dict(learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-6, clip_gradient=0.3, rescale_grad=2.0)),
]


@pytest.mark.parametrize("name,params", OPTIMIZER_CASES)
def test_optimizers_equal_mxnet_update_operators(name, params):
    """gradpack's Rust optimizers take the very same float32 steps as MXNet's."""
    if os.environ.get("GRADPACK_REQUIRE_MXNET") == "1":
        import mxnet as mx
    else:
        mx = pytest.importorskip("mxnet")
    rng = np.random.default_rng(3)
    w0 = rng.normal(0, 1, 257).astype(np.float32)
    kv = gradpack.kv.create("device")
    kv.set_optimizer(name, **params)
    kv.init(0, w0)
    w = mx.nd.array(w0)
    mom, mean, var = mx.nd.zeros(257), mx.nd.zeros(257), mx.nd.zeros(257)
    lr = params["learning_rate"]
    common = dict(wd=params.get("wd", 0.0), rescale_grad=params.get("rescale_grad", 1.0),
                  clip_gradient=params.get("clip_gradient", -1.0))
    for t in range(1, 5):
        g = rng.normal(0, 1, 257).astype(np.float32)
        kv.push(0, g)
        gm = mx.nd.array(g)
        if name in ("sgd", "nag") and "momentum" not in params:
            mx.nd.sgd_update(w, gm, lr=lr, out=w, **common)
        elif name == "sgd":
            mx.nd.sgd_mom_update(w, gm, mom, lr=lr, momentum=params["momentum"], out=w, **common)
        elif name == "nag":
            mx.nd.nag_mom_update(w, gm, mom, lr=lr, momentum=params["momentum"], out=w, **common)
        else:
            b1, b2 = params.get("beta1", 0.9), params.get("beta2", 0.999)
            lr_t = lr * (math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t))  # as MXNet's Adam.update
            mx.nd.adam_update(w, gm, mean, var, lr=lr_t, beta1=b1, beta2=b2,
                              epsilon=params.get("epsilon", 1e-8), out=w, **common)
        np.testing.assert_array_equal(pulled(kv, 0, (257,)), w.asnumpy(), err_msg="step %d" % t)


def mean_of_pushes(kv, grads, trials):
    """Key 0 of a fresh store, pushed `grads` (one per device) `trials`
    times: the mean of what it held after each push."""
    kv.init(0, np.zeros(grads[0].shape, np.float32))
    mean = np.zeros(grads[0].shape)
    for _ in range(trials):
        kv.push(0, grads)
        mean += pulled(kv, 0, grads[0].shape) / trials
    return mean


def test_qsgd_on_a_device_store_is_unbiased():
    kv = gradpack.kv.create("device")
    kv.set_compress({"compress": "qsgd_mn", "bits": "2", "seed": 1})
    rng = np.random.default_rng(5)
    grads = [rng.uniform(-1, 1, 64).astype(np.float32) for _ in range(2)]
    trials = 400
    mean = mean_of_pushes(kv, grads, trials)
    scale = max(np.abs(g).max() for g in grads)
    sigma = scale / 3 / 2 / np.sqrt(trials) * np.sqrt(2)  # (M/s)/2 per device, 2 devices
    np.testing.assert_allclose(mean, grads[0] + grads[1], atol=5 * sigma)
    # Counted, per device and push: the scale (one float32, 4 bytes) and 64
    # codes in -1..1 summed over 2 devices (-2..2: 3-bit lanes, 21 to a
    # 64-bit word, so 4 words).
    assert kv.stats()["wire_bytes"] == trials * 2 * (4 + 8 * 4)
    with pytest.raises(gradpack.Error, match="'bits': must be between 1 and 15"):
        kv.set_compress({"compress": "qsgd_mn", "bits": 16})
    with pytest.raises(gradpack.Error, match="create a 'device' store"):
        gradpack.kv.create("local").set_compress({"compress": "qsgd_mn", "bits": 4})


@pytest.mark.parametrize("params", [
    {"compress": "qsgd_mn_ts", "bits": [2, 6], "seed": 3},
    {"compress": "qsgd_mn_ms", "bits": (1, 3, 6)},
    {"compress": "grandk_mn_ts", "bits": [3, 6], "k": 64},  # k >= size: every coordinate
], ids=lambda p: p["compress"])
def test_multi_scale_schemes_on_a_device_store_are_unbiased(params):
    kv = gradpack.kv.create("device")
    kv.set_compress(params)
    rng = np.random.default_rng(6)
    grads = [rng.uniform(-0.05, 0.05, 64).astype(np.float32) for _ in range(2)]
    grads[0][5] = 1.0  # one large element: coarse there, fine elsewhere
    trials = 400
    mean = mean_of_pushes(kv, grads, trials)
    scale = 1.0
    coarse = scale / (2 ** params["bits"][0] - 1)
    sigma = coarse / 2 / np.sqrt(trials) * np.sqrt(2)
    np.testing.assert_allclose(mean, grads[0] + grads[1], atol=5 * sigma)


def test_powersgd_and_one_bit_keep_what_they_did_not_send():
    rng = np.random.default_rng(7)
    g = rng.standard_normal((16, 8)).astype(np.float32)
    for params in ({"compress": "powersgd", "rank": 1}, {"compress": "1bit", "threshold": 0.0}):
        kv = gradpack.kv.create("device")
        kv.set_compress(params)
        kv.init(0, np.zeros((16, 8), np.float32))
        sent = np.zeros((16, 8), np.float64)
        for step in range(5):
            kv.push(0, [g])
            sent += pulled(kv, 0, (16, 8))
            # error feedback: everything pushed = everything sent + what is kept back
            np.testing.assert_allclose(sent + kv.residual(0, 0), (step + 1) * g.astype(np.float64), atol=1e-4)


def test_powersgd_recovers_after_a_zero_push_and_a_spike():
    # A zero first push collapses Q (LoRA's zero-initialised B gives A a zero
    # gradient); a 1e10 spike overflows float32's squares. Either way the
    # next pushes start from a Q drawn anew, never a silent zero.
    rng = np.random.default_rng(8)
    for case in ("zero_first", "spike"):
        kv = gradpack.kv.create("device")
        kv.set_compress({"compress": "powersgd", "rank": 1, "seed": 1})
        kv.init(0, np.zeros((64, 32), np.float32))
        for step in range(5):
            grads = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(2)]
            if case == "zero_first" and step == 0:
                grads = [np.zeros((64, 32), np.float32)] * 2
            if case == "spike" and step == 1:
                grads[1] *= np.float32(1e10)
            kv.push(0, grads)
            out = pulled(kv, 0, (64, 32))
            assert np.isfinite(out).all(), (case, step)
            if step > 0:
                assert np.abs(out).max() > 0.5, (case, step, np.abs(out).max())


def test_powersgd_refuses_a_sum_past_float32_and_keeps_its_state():
    kv = gradpack.kv.create("device")
    kv.set_compress({"compress": "powersgd", "rank": 2, "seed": 3})
    kv.init(0, np.zeros((16, 12), np.float32))
    g = np.random.default_rng(9).standard_normal((16, 12)).astype(np.float32)
    kv.push(0, [g, g])
    before = [kv.residual(0, d).copy() for d in range(2)], pulled(kv, 0, (16, 12))
    with pytest.raises(gradpack.Error, match="PowerSGD: the workers. sum of P holds .*non-finite"):
        kv.push(0, [np.full((16, 12), 3e38, np.float32)] * 2)
    after = [kv.residual(0, d) for d in range(2)], pulled(kv, 0, (16, 12))
    for a, b in zip(before[0] + [before[1]], after[0] + [after[1]]):
        np.testing.assert_array_equal(a, b)
    kv.push(0, [g, g])  # the key still works


def test_scheme_parameters_are_validated_by_name():
    kv = gradpack.kv.create("device")
    for params, message in [
        ({"compress": "qsgd_mn_ts", "bits": 4}, "'bits': 'qsgd_mn_ts' takes two values"),
        ({"compress": "qsgd_mn_ms", "bits": [4, 2]}, "'bits': scales must be ascending"),
        ({"compress": "grandk_mn", "bits": 4}, "'k': missing"),
        ({"compress": "grandk_mn", "bits": 4, "k": -1}, "'k': must be a whole number >= 1"),
        ({"compress": "grandk_mn", "bits": 4, "k": 3, "unselected": "mine"}, "'unselected'"),
        ({"compress": "powersgd", "rank": 0}, "'rank': must be a whole number from 1"),
        ({"compress": "powersgd", "threshold": 1}, "'threshold': unknown key for compression 'powersgd'"),
        ({"compress": "4bit"}, "unknown compression type '4bit'"),
    ]:
        with pytest.raises(gradpack.Error, match=message):
            kv.set_compress(params)


def test_c_abi_refuses_shapes_whose_product_overflows():
    """[2^32, 2^32] wraps to 0 elements in unchecked arithmetic: through the C
    ABI it is an error naming the shape, and nothing is stored."""
    import ctypes
    from gradpack import kv as kvmod
    from gradpack.base import LIB
    kv = gradpack.kv.create("device")
    for dims in ([1 << 32, 1 << 32], [1 << 63, 4], [(1 << 64) - 1]):
        shape = (ctypes.c_uint64 * len(dims))(*dims)
        arr = kvmod._Array(None, 0, len(dims), shape)
        assert LIB.gp_kvstore_init(kv.handle, kvmod._Key(0, None), arr) != 0
        assert "memory" in LIB.gp_error_last().decode(), LIB.gp_error_last()
    with pytest.raises(gradpack.Error, match="not initialized"):
        kv.pull(0, out=np.zeros(1, np.float32))


@pytest.mark.parametrize("store", ["local", "device"])
def test_keys_out_of_range_or_holding_nul_are_errors(store):
    """ctypes would wrap 2**64 onto key 0 and cut 'w\\x00evil' onto 'w'."""
    kv = gradpack.kv.create(store)
    kv.init(0, np.ones(4, np.float32))
    for bad in (2 ** 64, 2 ** 63, -(2 ** 63) - 1, np.uint64(2 ** 63)):
        with pytest.raises(gradpack.Error, match="signed 64-bit"):
            kv.push(bad, np.full(4, 9, np.float32))
    out = np.zeros(4, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [1.0] * 4
    kv.init(2 ** 63 - 1, np.full(4, 2, np.float32))   # the extremes are keys
    s = gradpack.kv.create(store)
    s.init("w", np.ones(4, np.float32))
    for op in (lambda: s.init("w\x00evil", np.full(4, 9, np.float32)),
               lambda: s.push("w\x00evil", np.full(4, 9, np.float32))):
        with pytest.raises(gradpack.Error, match="cannot contain NUL"):
            op()
    s.pull("w", out=out)
    assert out.tolist() == [1.0] * 4


def test_pushpull_into_the_pushed_array_and_non_finite_pushes():
    """MXNet's Trainer (update_on_kvstore=False) pushpulls a gradient into
    itself: the C ABI copies such an input before writing any output. A NaN
    under 2-bit changes nothing."""
    kv = gradpack.kv.create("device")
    kv.set_compress({"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
    kv.init("w", np.zeros(20, np.float32))
    a, b = np.full(20, 0.6, np.float32), np.full(20, 0.6, np.float32)
    kv.pushpull("w", [a, b], out=[a, b])
    assert a.tolist() == [1.0] * 20 and b.tolist() == [1.0] * 20
    bad = np.full(20, 0.2, np.float32)
    bad[4] = np.nan
    before = kv.residual("w", 0).copy()
    out = np.full(20, 9.0, np.float32)
    with pytest.raises(gradpack.Error, match="key 'w'.*at element 4"):
        kv.pushpull("w", [bad, np.zeros(20, np.float32)], out=out)
    assert np.array_equal(kv.residual("w", 0), before) and (out == 9.0).all()
    with pytest.raises(gradpack.Error, match="pushpull output 0"):
        kv.pushpull("w", [a, b], out=np.zeros(3, np.float32))
    kv.pull("w", out=out)
    assert out.tolist() == [1.0] * 20


@pytest.mark.parametrize("store", ["local", "device"])
def test_careless_configuration_is_refused_and_changes_nothing(store):
    """Each of these was accepted silently: now an error naming the problem,
    with the store's values, residuals and settings as they were."""
    kv = gradpack.kv.create(store)
    if store == "device":
        kv.set_compress({"compress": "2bit", "threshold": 0.5})
    kv.init("w", np.zeros(8, np.float32))
    with pytest.raises(gradpack.Error, match="set the gradient compression before initializing any key"):
        kv.set_compress({"compress": "2bit", "threshold": 0.25} if store == "device" else {"compress": "none"})
    with pytest.raises(gradpack.Error, match="'momentum': must be 0 or more, got -1"):
        kv.set_optimizer("sgd", learning_rate=1.0, momentum=-1)
    kv.set_optimizer("sgd", learning_rate=1.0)
    with pytest.raises(gradpack.Error, match="'rescale_grad': must be a finite number, 0 or more, got NaN"):
        kv.set_grad_scaling(float("nan"))
    with pytest.raises(gradpack.Error, match="'clip_gradient': must be finite"):
        kv.set_grad_scaling(1.0, float("inf"))
    with pytest.raises(gradpack.Error, match="key 'v': not initialized"):
        kv.set_rates("v", 0.1, 0.0)
    with pytest.raises(gradpack.Error, match="'wd': must be a finite number, 0 or more, got -1"):
        kv.set_rates("w", 0.1, -1.0)
    g = np.full(8, -0.3, np.float32)
    kv.push("w", [g, g])  # lr 1: sgd's w -= merged
    out = np.zeros(8, np.float32)
    kv.pull("w", out=out)
    assert out.tolist() == ([0.0] * 8 if store == "device" else [np.float32(0.6)] * 8)
    if store == "device":
        assert kv.residual("w", 1).tolist() == [np.float32(-0.3)] * 8
        with pytest.raises(gradpack.Error, match="no residual on device 5: 2 device\\(s\\) pushed it"):
            kv.residual("w", 5)
    else:
        with pytest.raises(gradpack.Error, match="no residual on device 0: it has not been pushed with compression"):
            kv.residual("w", 0)


def test_an_updater_that_raises_leaves_value_and_residuals():
    kv = gradpack.kv.create("device")
    kv.set_compress({"compress": "2bit", "threshold": 0.5})
    kv.init(3, np.zeros(8, np.float32))
    g = np.full(8, 0.3, np.float32)
    kv.push(3, [g, g])  # residuals 0.3, value 0

    def broken(key, merged, stored):
        stored[:] = 42  # half-way through ...
        raise RuntimeError("updater gave up")
    kv.set_updater(broken)
    with pytest.raises(RuntimeError, match="updater gave up"):
        kv.push(3, [g, g])
    assert kv.residual(3, 0).tolist() == [np.float32(0.3)] * 8
    out = np.full(8, 9, np.float32)
    kv.pull(3, out=out)
    assert out.tolist() == [0.0] * 8
    kv.set_updater(lambda key, merged, stored: stored.__iadd__(merged))
    kv.push(3, [g, g])  # 0.6 on both devices: 0.5 each sent
    kv.pull(3, out=out)
    assert out.tolist() == [1.0] * 8


def test_a_store_refuses_copies_and_pickling_and_works_on():
    """copy.copy used to share the native store, freed twice when both were
    dropped: run apart, so that a crash fails the test."""
    import subprocess
    import sys
    code = """
import copy, gc, pickle
import numpy as np
import gradpack
kv = gradpack.kv.create("device")
kv.set_compress({"compress": "2bit", "threshold": 0.5})
kv.init(1, np.zeros(4, np.float32))
for f in (copy.copy, copy.deepcopy, pickle.dumps):
    try:
        f(kv)
    except gradpack.Error as e:
        assert str(e).startswith("a gradpack.kv.KVStore cannot be ") and "set_compression_states()" in str(e), e
    else:
        raise AssertionError("%s was not refused" % f.__name__)
kv.push(1, np.full(4, 0.7, np.float32))
out = np.zeros(4, np.float32)
kv.pull(1, out=out)
assert out.tolist() == [0.5] * 4, out
del kv
gc.collect()
print("done")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "done\n", (r.returncode, r.stdout, r.stderr[-3000:])


def test_a_padded_role_serves_from_create_and_from_gradpack_node():
    """DMLC_ROLE='server ' is a server (as gradpack-node reads it): with no
    scheduler listening, it fails as a server does, before the script goes on."""
    import subprocess
    import sys
    from gradpack.launch import free_port
    env = dict(os.environ, DMLC_ROLE=" server ", DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()),
               DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", PS_HEARTBEAT_TIMEOUT="2")
    for args in (["-c", "import gradpack; gradpack.kv.create('dist_sync'); print('ran as a worker')"],
                 ["-m", "gradpack.node"]):
        r = subprocess.run([sys.executable] + args, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "ran as a worker" not in r.stdout, (args, r.stdout, r.stderr)
        assert "gradpack server: " in r.stderr and "scheduler" in r.stderr, (args, r.stderr)


def test_settings_holding_nul_are_refused_not_cut():
    kv = gradpack.kv.create("device")
    for params in ({"compress": "2bit\0x"}, {"compress": "2bit", "threshold\0": 0.5}):
        with pytest.raises(gradpack.Error, match="holds a NUL character"):
            kv.set_compress(params)
    with pytest.raises(gradpack.Error, match="holds a NUL character"):
        kv.set_optimizer("sgd", **{"learning_rate\0x": 0.1})
    kv.init(1, full(0.0))  # compression still unset: a plain sum
    kv.push(1, [full(0.3), full(0.4)])
    np.testing.assert_array_equal(pulled(kv, 1), full(np.float32(0.3) + np.float32(0.4)))
