"""The operators inside a real MXNet 1.9.1: golden and random data equal to the
numpy path, in-place mutation of the very same memory, clear errors."""
import os

import numpy as np
import pytest

import gradpack
from gradpack.nd import contrib as npc

if os.environ.get("GRADPACK_REQUIRE_MXNET") == "1":
    import mxnet as mx  # the test command insists: a missing MXNet fails, never skips
else:
    mx = pytest.importorskip("mxnet")

import gradpack.mxnet as gpmx  # noqa: E402


def bits(a):
    return a.view(np.uint32)


@pytest.mark.parametrize("positional", [True, False])
def test_golden_example(positional):
    grad = mx.nd.array([0, 2.5, 1, -3, 2, 0.5, -1, -2])
    residual = mx.nd.zeros(8)
    compr = mx.nd.contrib.create_2bit(grad)
    assert compr.shape == (4,) and compr.dtype == np.float32
    if positional:
        mx.nd.contrib.quantize_2bit(grad, residual, compr, -2.0, 2.0)
    else:
        mx.nd.contrib.quantize_2bit(grad, residual, compr, neg_threshold=-2.0, pos_threshold=2.0)
    assert bits(compr.asnumpy()).tolist()[3] == 0x12420000
    assert compr.asnumpy()[:3].tolist() == [-2.0, 2.0, 8.0]
    assert residual.asnumpy().tolist() == [0, 0.5, 1, -1, 0, 0.5, -1, 0]
    out = mx.nd.zeros(8)
    mx.nd.contrib.dequantize_2bit(compr, out)
    assert out.asnumpy().tolist() == [0, 2, 0, -2, 2, 0, 0, -2]


def test_contrib_namespace_alias():
    import mxnet.contrib  # noqa: F401
    grad = mx.nd.array([3.0] * 20)
    residual = mx.nd.zeros(20)
    compr = mx.contrib.nd.create_2bit(grad)
    mx.contrib.nd.quantize_2bit(grad, residual, compr, -2.0, 2.0)
    assert (residual.asnumpy() == 1.0).all()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("n", [1, 16, 17, 1000, 65537])
def test_random_equals_numpy_path(dtype, n):
    rng = np.random.default_rng(7)
    residual = mx.nd.zeros(n)
    np_residual = np.zeros(n, np.float32)
    for _ in range(3):
        g = rng.uniform(-0.7, 0.7, n).astype(dtype)
        compr = mx.nd.contrib.create_2bit(mx.nd.array(g, dtype=dtype))
        mx.nd.contrib.quantize_2bit(mx.nd.array(g, dtype=dtype), residual, compr, -0.5, 0.5)
        np_compr = npc.create_2bit(g)
        npc.quantize_2bit(g, np_residual, np_compr, -0.5, 0.5)
        np.testing.assert_array_equal(bits(compr.asnumpy()), bits(np_compr))
        np.testing.assert_array_equal(bits(residual.asnumpy()), bits(np_residual))
        out = mx.nd.zeros(n)
        mx.nd.contrib.dequantize_2bit(compr, out)
        np_out = np.empty(n, np.float32)
        npc.dequantize_2bit(np_compr, np_out)
        np.testing.assert_array_equal(out.asnumpy(), np_out)


def test_mutation_in_place_without_copies():
    # NDArrays that share memory with numpy arrays: the op must write there.
    np_residual = np.zeros(40, np.float32)
    np_compr = npc.create_2bit(np_residual)
    residual = mx.nd.from_numpy(np_residual, zero_copy=True)
    compr = mx.nd.from_numpy(np_compr, zero_copy=True)
    mx.nd.contrib.quantize_2bit(mx.nd.full(40, 0.75), residual, compr, -0.5, 0.5)
    mx.nd.waitall()
    assert (np_residual == 0.25).all()
    assert bits(np_compr)[3] == 0x55555555 and np_compr[2] == 40


def setup_arrays(n=33):
    grad = mx.nd.array(np.linspace(-1, 1, n))
    return grad, mx.nd.full(n, 0.125), mx.nd.full(npc.create_2bit(np.zeros(n)).size, 9)


def assert_untouched(residual, compr):
    assert (residual.asnumpy() == 0.125).all() and (compr.asnumpy() == 9).all()


@pytest.mark.parametrize("kwargs,msg", [
    (dict(neg_threshold=0.5, pos_threshold=0.5), "neg_threshold must be < 0"),
    (dict(neg_threshold=-0.5, pos_threshold="nan"), "finite"),
    (dict(neg_threshold="abc", pos_threshold=0.5), "must be a number"),
    (dict(neg_threshold=-0.5), "needs neg_threshold and pos_threshold"),
    (dict(neg_threshold=-0.5, pos_threshold=0.5, threshold=1), "unknown attribute 'threshold'"),
])
def test_quantize_bad_attributes(kwargs, msg):
    grad, residual, compr = setup_arrays()
    with pytest.raises(gpmx.OperatorError, match=msg):
        mx.nd.contrib.quantize_2bit(grad, residual, compr, **kwargs)
    assert_untouched(residual, compr)


def test_quantize_bad_shapes_and_dtypes():
    grad, residual, compr = setup_arrays()
    cases = [
        (grad, mx.nd.zeros(32), compr, "residual has 32 elements, expected 33"),
        (grad, residual, mx.nd.zeros(5), "compr has 5 elements, expected 6"),
        (grad.astype("float64"), residual, compr, "grad has dtype float64"),
        (grad, residual.astype("float16"), compr, "residual has dtype float16"),
        (grad, residual, compr.astype("int32"), "compr has dtype int32"),
    ]
    for g, r, cp, msg in cases:
        with pytest.raises(gpmx.OperatorError, match=msg) as info:
            mx.nd.contrib.quantize_2bit(g, r, cp, -0.5, 0.5)
        assert isinstance(info.value, mx.base.MXNetError) and isinstance(info.value, gradpack.Error)
    assert_untouched(residual, compr)


def test_dequantize_corrupt_block_leaves_output():
    compr = mx.nd.contrib.create_2bit(mx.nd.zeros(20))
    mx.nd.contrib.quantize_2bit(mx.nd.ones(20), mx.nd.zeros(20), compr, -0.5, 0.5)
    raw = compr.asnumpy()
    bits(raw)[4] |= np.uint32(0b11 << 30)
    out = mx.nd.full(20, 3)
    with pytest.raises(gpmx.OperatorError, match="element 16 has code 0b11"):
        mx.nd.contrib.dequantize_2bit(mx.nd.array(raw), out)
    assert (out.asnumpy() == 3).all()
    with pytest.raises(gpmx.OperatorError, match="compr has 6 elements, expected 5"):
        mx.nd.contrib.dequantize_2bit(mx.nd.zeros(6), out)


def test_symbolic_use_is_refused():
    a, b, cc = mx.sym.var("a"), mx.sym.var("b"), mx.sym.var("c")
    with pytest.raises(gpmx.OperatorError, match="no symbolic form"):
        mx.sym.contrib.quantize_2bit(a, b, cc, -0.5, 0.5)
    with pytest.raises(gpmx.OperatorError, match="no symbolic form"):
        mx.sym.contrib.dequantize_2bit(a, b)
