"""gradpack.nd.contrib on numpy arrays: exact bits against the golden example,
the committed vectors and an independent numpy model; every error rule with
outputs untouched."""
import json
import os

import ml_dtypes  # installed by the set-up: a missing one fails, never skips the module
import numpy as np
import pytest

import gradpack
from gradpack.nd import contrib as c

import numpy_2bit

VECTORS = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "vectors", "2bit.json")
DTYPES = {"float32": (np.float32, np.uint32), "float16": (np.float16, np.uint16),
          "bfloat16": (ml_dtypes.bfloat16, np.uint16)}


def bits(a):
    return a.view(np.uint32)


def test_golden_example():
    grad = np.array([0, 2.5, 1, -3, 2, 0.5, -1, -2], np.float32)
    residual = np.zeros(8, np.float32)
    compr = c.create_2bit(grad)
    assert compr.dtype == np.float32 and compr.shape == (4,) and not compr.any()
    c.quantize_2bit(grad, residual, compr, -2.0, 2.0)
    assert bits(compr).tolist() == [bits(np.float32([-2.0]))[0], bits(np.float32([2.0]))[0],
                                    bits(np.float32([8.0]))[0], 0x12420000]
    assert compr[3] == np.float32(6.1215606e-28)
    assert residual.tolist() == [0, 0.5, 1, -1, 0, 0.5, -1, 0]
    out = np.full(8, 7, np.float32)
    c.dequantize_2bit(compr, out)
    assert out.tolist() == [0, 2, 0, -2, 2, 0, 0, -2]
    c.dequantize_2bit_add(compr, out)
    assert out.tolist() == [0, 4, 0, -4, 4, 0, 0, -4]


def test_committed_vectors():
    with open(VECTORS) as f:
        cases = json.load(f)["cases"]
    for case in cases:
        ftype, itype = DTYPES[case["dtype"]]
        n = case["n"]
        residual = np.zeros(n, np.float32)
        for step in case["steps"]:
            grad = np.array(step["grad_bits"], dtype=itype).view(ftype)
            compr = c.create_2bit(grad)
            c.quantize_2bit(grad, residual, compr, case["neg_threshold"], case["pos_threshold"])
            assert bits(compr).tolist() == step["compr_bits"], (case["dtype"], n)
            assert bits(residual).tolist() == step["residual_bits"], (case["dtype"], n)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 65535, 65536, 65537, 1_000_003])
def test_random_matches_numpy_model(dtype, n):
    rng = np.random.default_rng(n)
    ftype = DTYPES[dtype][0]
    residual = np.zeros(n, np.float32)
    model_residual = residual.copy()
    for _ in range(3):
        grad = rng.uniform(-0.7, 0.7, n).astype(np.float32).astype(ftype)
        compr = c.create_2bit(grad)
        c.quantize_2bit(grad, residual, compr, -0.5, 0.5)
        want, model_residual = numpy_2bit.quantize(grad, model_residual, -0.5, 0.5)
        np.testing.assert_array_equal(bits(compr), bits(want))
        np.testing.assert_array_equal(bits(residual), bits(model_residual))
        out = np.empty(n, np.float32)
        c.dequantize_2bit(compr, out)
        np.testing.assert_array_equal(out, numpy_2bit.dequantize(want, n))


def test_in_place_and_zero_copy():
    grad = np.full(40, 0.75, np.float32)
    residual = np.zeros(40, np.float32)
    compr = c.create_2bit(grad)
    r_ptr, c_ptr = residual.ctypes.data, compr.ctypes.data
    c.quantize_2bit(grad, residual, compr, -0.5, 0.5)
    assert residual.ctypes.data == r_ptr and compr.ctypes.data == c_ptr
    assert (residual == 0.25).all()
    # a view into a larger buffer is written where it lies
    big = np.zeros(100, np.float32)
    c.quantize_2bit(grad, big[10:50], compr, -0.5, 0.5)
    assert (big[10:50] == 0.25).all() and not big[:10].any() and not big[50:].any()


def test_error_is_value_error():
    assert issubclass(gradpack.Error, ValueError)


def setup_quantize(n=33):
    grad = np.linspace(-1, 1, n).astype(np.float32)
    return grad, np.full(n, 0.125, np.float32), np.full(c.create_2bit(grad).size, 9, np.float32)


def assert_untouched(residual, compr):
    assert (residual == 0.125).all() and (compr == 9).all()


@pytest.mark.parametrize("neg,pos,msg", [
    (0.0, 0.5, "neg_threshold must be < 0"), (-0.5, 0.0, "pos_threshold must be > 0"),
    (0.5, -0.5, "neg_threshold must be < 0"), (float("nan"), 0.5, "finite"),
    (-0.5, float("inf"), "finite"), ("x", 0.5, "numbers"), (None, 0.5, "numbers")])
def test_quantize_rejects_bad_thresholds(neg, pos, msg):
    grad, residual, compr = setup_quantize()
    with pytest.raises(gradpack.Error, match=msg):
        c.quantize_2bit(grad, residual, compr, neg, pos)
    assert_untouched(residual, compr)


def test_quantize_rejects_bad_buffers():
    grad, residual, compr = setup_quantize()
    cases = [
        (grad, residual[:-1].copy(), compr, "residual has 32 elements, expected 33"),
        (grad, residual, compr[:-1].copy(), "compressed array has 5 elements, expected 6"),
        (grad.astype(np.float64), residual, compr, "grad has dtype float64"),
        (grad.astype(np.int32), residual, compr, "grad has dtype int32"),
        (grad, residual.astype(np.float16), compr, "residual has dtype float16"),
        (grad, residual, compr.astype(np.float64), "compr has dtype float64"),
        (np.repeat(grad, 2)[::2], residual, compr, "grad must be C-contiguous"),
        (grad, np.repeat(residual, 2)[::2], compr, "residual must be C-contiguous"),
        (grad.tolist(), residual, compr, "grad must be a numpy.ndarray"),
    ]
    for g, r, cp, msg in cases:
        with pytest.raises(gradpack.Error, match=msg):
            c.quantize_2bit(g, r, cp, -0.5, 0.5)
    assert_untouched(residual, compr)
    for name in ("residual", "compr"):
        r, cp = residual.copy(), compr.copy()
        (r if name == "residual" else cp).flags.writeable = False
        with pytest.raises(gradpack.Error, match="%s is read-only" % name):
            c.quantize_2bit(grad, r, cp, -0.5, 0.5)
        assert_untouched(r, cp)


def test_quantize_rejects_overlapping_buffers():
    buf = np.zeros(40, np.float32)
    grad = np.ones(33, np.float32)
    with pytest.raises(gradpack.Error, match="overlap"):
        c.quantize_2bit(grad, buf[:33], buf[30:36], -0.5, 0.5)
    assert not buf.any()


def valid_compr(n=37):
    grad = np.where(np.arange(n) % 3 == 0, 1.0, -1.0).astype(np.float32)
    compr = c.create_2bit(grad)
    c.quantize_2bit(grad, np.zeros(n, np.float32), compr, -0.5, 0.5)
    return compr


def corrupt(compr, index, value=None, word=None):
    compr = compr.copy()
    if word is not None:
        bits(compr)[index] |= np.uint32(word)
    else:
        compr[index] = value
    return compr


@pytest.mark.parametrize("make,n,msg", [
    (lambda g: g[:-1].copy(), 37, "compressed array has 5 elements, expected 6"),
    (lambda g: g, 21, "compressed array has 6 elements, expected 5"),
    (lambda g: g, 36, "header says size 37 but the output has 36"),
    (lambda g: corrupt(g, 0, 0.5), 37, "neg_threshold must be < 0"),
    (lambda g: corrupt(g, 1, np.nan), 37, "finite"),
    (lambda g: corrupt(g, 4, word=0b11 << 20), 37, "block 1: element 21 has code 0b11"),
    (lambda g: corrupt(g, 5, word=0b01 << 20), 37, "padding past size 37"),
])
def test_dequantize_rejects_corrupt_input(make, n, msg):
    compr = make(valid_compr())
    for fn in (c.dequantize_2bit, c.dequantize_2bit_add):
        out = np.full(n, 3, np.float32)
        with pytest.raises(gradpack.Error, match=msg):
            fn(compr, out)
        assert (out == 3).all()


def test_dequantize_rejects_bad_output():
    compr = valid_compr()
    with pytest.raises(gradpack.Error, match="decompr has dtype float64"):
        c.dequantize_2bit(compr, np.zeros(37))
    out = np.zeros(37, np.float32)
    out.flags.writeable = False
    with pytest.raises(gradpack.Error, match="decompr is read-only"):
        c.dequantize_2bit(compr, out)


def test_large_n_header_rounds_to_nearest():
    n = (1 << 24) + 1
    grad = np.full(n, 0.75, np.float16)
    residual = np.zeros(n, np.float32)
    compr = c.create_2bit(grad)
    c.quantize_2bit(grad, residual, compr, -0.5, 0.5)
    assert compr[2] == np.float32(16777216.0)
    out = np.empty(n, np.float32)
    c.dequantize_2bit(compr, out)
    assert (out == 0.5).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_sums_are_refused_untouched(dtype, bad):
    """docs/contract.md §1: a NaN or ±inf in residual + grad fails naming the first such
    element, and neither the residual nor the compressed array changes."""
    np_dtype = DTYPES[dtype][0]
    grad = np.full(40, 0.3, np.float32)
    grad[21] = bad
    grad[30] = np.nan
    grad = grad.astype(np_dtype)
    residual = np.full(40, 0.1, np.float32)
    compr = np.full(6, 7.0, np.float32)
    with pytest.raises(gradpack.Error, match="at element 21"):
        c.quantize_2bit(grad, residual, compr, -0.5, 0.5)
    assert (residual == np.float32(0.1)).all() and (compr == 7.0).all()


def test_residual_overflow_is_refused():
    grad = np.full(17, 3e38, np.float32)
    residual = np.zeros(17, np.float32)
    compr = c.create_2bit(grad)
    c.quantize_2bit(grad, residual, compr, -0.5, 0.5)
    kept = (residual.copy(), compr.copy())
    with pytest.raises(gradpack.Error, match="at element 0"):
        c.quantize_2bit(grad, residual, compr, -0.5, 0.5)
    assert np.array_equal(residual, kept[0]) and np.array_equal(compr.view(np.uint32), kept[1].view(np.uint32))


def test_gradpack_kernel_caps_each_process_and_names_a_value_it_does_not_know():
    import subprocess
    import sys
    probe = "import gradpack; print(gradpack.scheme_kernel_name(), gradpack.kernel_name())"

    def run(value):
        env = dict(os.environ)
        env.pop("GRADPACK_KERNEL", None)
        if value is not None:
            env["GRADPACK_KERNEL"] = value
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split(), out.stderr

    (widest, codec), err = run(None)
    assert widest in ("portable", "avx2", "avx512") and err == ""
    assert run("portable") == (["portable", "portable"], "")
    assert run("avx512") == ([widest, codec], "")
    if widest != "portable":
        assert run("avx2") == (["avx2", codec], "")
    # A typo runs what no value runs, and says so once.
    names, err = run("portble")
    assert names == [widest, codec]
    assert err.count('GRADPACK_KERNEL="portble" is not one of portable, avx2, avx512') == 1, err
