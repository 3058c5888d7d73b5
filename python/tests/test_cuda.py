"""gradpack.cuda: on every machine, the not-available error and the array
checks; on a GPU machine with CuPy (GRADPACK_REQUIRE_GPU=1 makes a missing
GPU a failure, not a skip), every function against the CPU's bits through
both the CUDA array interface and DLPack."""
import os

import numpy as np
import pytest

import gradpack
from gradpack import cuda
from gradpack.nd import contrib

REQUIRE_GPU = os.environ.get("GRADPACK_REQUIRE_GPU") == "1"


class FakeGpuArray:
    """A CUDA-array-interface object whose pointer is not device memory."""

    def __init__(self, n, typestr="<f4", readonly=False, strides=None):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (0x1000, readonly),
                                         "version": 3, "strides": strides, "stream": None}


def test_unavailable_or_refused_with_a_clear_error():
    reason = cuda.unavailable_reason()
    g, r, c = FakeGpuArray(10), FakeGpuArray(10), FakeGpuArray(cuda.create_2bit(10))
    with pytest.raises(gradpack.Error) as e:
        cuda.quantize_2bit(g, r, c, -0.5, 0.5)
    if reason is None:  # a GPU: the fake pointer is refused before any kernel runs
        assert "is not device memory" in str(e.value)
    else:
        assert reason.startswith("CUDA not available: "), reason
        assert str(e.value) == reason
        assert not cuda.available()


def test_arrays_are_checked_before_the_library_sees_them():
    with pytest.raises(gradpack.Error, match="must be a GPU array"):
        cuda.max_abs([0.0, 1.0])
    with pytest.raises(gradpack.Error, match=r"x is not on a CUDA GPU \(DLPack device type 1\)"):
        cuda.max_abs(np.zeros(4, np.float32))  # a CPU array through DLPack
    with pytest.raises(gradpack.Error, match="grad must be float32 or float16 or bfloat16, got typestr '<f8'"):
        cuda.quantize_2bit(FakeGpuArray(4, "<f8"), FakeGpuArray(4), FakeGpuArray(4), -1, 1)
    with pytest.raises(gradpack.Error, match="residual is read-only"):
        cuda.quantize_2bit(FakeGpuArray(4), FakeGpuArray(4, readonly=True), FakeGpuArray(4), -1, 1)
    with pytest.raises(gradpack.Error, match="must be C-contiguous"):
        cuda.max_abs(FakeGpuArray(4, strides=(8,)))
    with pytest.raises(gradpack.Error, match="residual has 5 elements, expected 4"):
        cuda.quantize_2bit(FakeGpuArray(4), FakeGpuArray(5), FakeGpuArray(4), -1, 1)


def _cupy():
    if not cuda.available():
        if REQUIRE_GPU:
            pytest.fail("GRADPACK_REQUIRE_GPU=1: " + (cuda.unavailable_reason() or ""))
        pytest.skip("needs a GPU: " + cuda.unavailable_reason())
    try:
        import cupy
    except ImportError:
        if REQUIRE_GPU:
            raise
        pytest.skip("needs CuPy")
    return cupy


class DLPackOnly:
    """Exposes only __dlpack__ (as MXNet's GPU NDArrays do)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


@pytest.mark.parametrize("n", [1, 17, 4097, 1_000_003])
@pytest.mark.parametrize("wrap", ["cai", "dlpack"])
def test_gpu_matches_the_cpu_bit_for_bit(n, wrap):
    cp = _cupy()
    w = (lambda a: a) if wrap == "cai" else DLPackOnly
    rng = np.random.default_rng(n)
    g = rng.uniform(-1, 1, n).astype(np.float32)
    r0 = rng.uniform(-0.3, 0.3, n).astype(np.float32)
    # 2-bit, in place and in one pass, then decode and decode-add
    r, c = r0.copy(), contrib.create_2bit(g)
    contrib.quantize_2bit(g, r, c, -0.4, 0.25)
    gd, rd, cd = cp.asarray(g), cp.asarray(r0), cp.zeros(cuda.create_2bit(n), cp.float32)
    cuda.quantize_2bit(w(gd), w(rd), w(cd), -0.4, 0.25)
    assert cp.asnumpy(cd).view(np.uint32).tolist() == c.view(np.uint32).tolist()
    assert cp.asnumpy(rd).view(np.uint32).tolist() == r.view(np.uint32).tolist()
    xd, c2 = cp.zeros(n, cp.float32), cp.zeros(cuda.create_2bit(n), cp.float32)
    cuda.quantize_2bit_to(w(gd), w(cp.asarray(r0)), w(xd), w(c2), -0.4, 0.25)
    assert (cp.asnumpy(c2).view(np.uint32) == c.view(np.uint32)).all()
    assert (cp.asnumpy(xd).view(np.uint32) == r.view(np.uint32)).all()
    o, s = np.zeros(n, np.float32), g.copy()
    contrib.dequantize_2bit(c, o)
    contrib.dequantize_2bit_add(c, s)
    od, sd = cp.zeros(n, cp.float32), cp.asarray(g)
    cuda.dequantize_2bit(w(cd), w(od))
    cuda.dequantize_2bit_add(w(cd), w(sd))
    assert (cp.asnumpy(od).view(np.uint32) == o.view(np.uint32)).all()
    assert (cp.asnumpy(sd).view(np.uint32) == s.view(np.uint32)).all()
    # QSGD: codes decode back within one step of the value, and the GPU's max
    assert cuda.max_abs(w(gd)) == float(np.abs(g).max())
    codes = cp.zeros(n, cp.int32)
    scale = float(np.abs(g).max())
    cuda.qsgd_quantize(w(gd), scale, 4, 99, w(codes))
    dec = cp.zeros(n, cp.float32)
    cuda.qsgd_decode(w(codes), scale, 4, w(dec))
    assert np.abs(cp.asnumpy(dec) - g).max() <= scale / 15 * 1.0001
    # 1-bit
    rd1, bits = cp.asarray(r0), cp.zeros(n, cp.int32)
    cuda.onebit_quantize(w(gd), w(rd1), 0.0, w(bits))
    x = r0 + g
    assert (cp.asnumpy(bits) == (x > 0)).all()
    assert (cp.asnumpy(rd1).view(np.uint32) == np.where(x > 0, x - 1, x + 1).astype(np.float32).view(np.uint32)).all()


def test_gpu_bad_input_changes_nothing_and_streams_are_honoured():
    cp = _cupy()
    g = cp.asarray(np.linspace(-1, 1, 1000, dtype=np.float32))
    g[417] = cp.nan
    r = cp.full(1000, 0.125, cp.float32)
    c = cp.full(cuda.create_2bit(1000), 3.0, cp.float32)
    with pytest.raises(gradpack.Error, match="element 417"):
        cuda.quantize_2bit(g, r, c, -0.5, 0.5)
    assert (cp.asnumpy(r) == 0.125).all() and (cp.asnumpy(c) == 3.0).all()
    assert cuda.max_abs(g) is None
    # Work queued on a user stream before the call is seen by the call.
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        big = cp.ones(1 << 22, cp.float32) * 2.5
        out = cp.zeros(cuda.create_2bit(1 << 22), cp.float32)
        res = cp.zeros(1 << 22, cp.float32)
        cuda.quantize_2bit(big, res, out, -1.0, 1.0)  # the arrays name stream s
    assert float(cp.asnumpy(res)[0]) == 1.5


def test_gpu_reduce_over_two_streams_matches_the_cpu_store():
    cp = _cupy()
    n = 100_003
    rng = np.random.default_rng(5)
    gs = [rng.uniform(-1, 1, n).astype(np.float32) for _ in range(2)]
    rs = [rng.uniform(-0.2, 0.2, n).astype(np.float32) for _ in range(2)]
    want, res, comprs = np.zeros(n, np.float32), [r.copy() for r in rs], []
    for g, r in zip(gs, res):
        c = contrib.create_2bit(g)
        contrib.quantize_2bit(g, r, c, -0.3, 0.3)
        comprs.append(c)
    contrib.dequantize_2bit(comprs[0], want)
    contrib.dequantize_2bit_add(comprs[1], want)
    s1 = cp.cuda.Stream(non_blocking=True)
    gd = [cp.asarray(g) for g in gs]
    rd = [cp.asarray(r) for r in rs]
    out = cp.zeros(n, cp.float32)
    cp.cuda.Device().synchronize()
    cuda.reduce_2bit(gd, rd, out, -0.3, 0.3, streams=[0, s1.ptr])
    assert (cp.asnumpy(out).view(np.uint32) == want.view(np.uint32)).all()
    for r, x in zip(rd, res):
        assert (cp.asnumpy(r).view(np.uint32) == x.view(np.uint32)).all()
    # A bad member: the CPU's error, and no residual moves.
    gd[1][12345] = cp.inf
    before = [cp.asnumpy(r) for r in rd]
    with pytest.raises(gradpack.Error, match="pushed value 1: .* at element 12345"):
        cuda.reduce_2bit(gd, rd, out, -0.3, 0.3)
    for r, b in zip(rd, before):
        assert (cp.asnumpy(r) == b).all()
    with pytest.raises(gradpack.Error, match="overlap"):
        cuda.reduce_2bit([gd[0], gd[0]], [rd[0], rd[0]], out, -0.3, 0.3)


@pytest.mark.parametrize("wrap", ["cai", "dlpack"])
def test_gpu_float16_gradients_match_the_cpu(wrap):
    cp = _cupy()
    w = (lambda a: a) if wrap == "cai" else DLPackOnly
    n = 100_003
    rng = np.random.default_rng(9)
    g = rng.uniform(-1, 1, n).astype(np.float16)
    r0 = rng.uniform(-0.3, 0.3, n).astype(np.float32)
    r, c = r0.copy(), contrib.create_2bit(g)
    contrib.quantize_2bit(g, r, c, -0.4, 0.25)
    rd, cd = cp.asarray(r0), cp.zeros(cuda.create_2bit(n), cp.float32)
    cuda.quantize_2bit(w(cp.asarray(g)), w(rd), w(cd), -0.4, 0.25)
    assert (cp.asnumpy(cd).view(np.uint32) == c.view(np.uint32)).all()
    assert (cp.asnumpy(rd).view(np.uint32) == r.view(np.uint32)).all()
