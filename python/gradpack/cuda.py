"""gradpack's CUDA kernels on GPU arrays, in place and zero-copy.

Arrays are any objects with ``__cuda_array_interface__`` (CuPy, Numba,
PyTorch) or ``__dlpack__`` (CuPy, PyTorch, MXNet GPU NDArrays), contiguous,
on one GPU. Each call runs on the stream the array names (CUDA array
interface v3) or the ``stream`` argument (a ``CUstream`` handle as an int;
0 is the legacy default stream), and returns once that stream has run it,
so errors come back from the call that caused them. Results are
bit-identical to the CPU functions in ``gradpack.nd.contrib``.

Without a driver, a GPU, NVRTC, or a library built with the ``cuda``
feature, every call raises ``gradpack.Error("CUDA not available: ...")``;
``available()`` says whether calls can work, ``unavailable_reason()`` why not.
NVRTC comes from the PyPI package ``nvidia-cuda-nvrtc-cu12`` when it is
installed (loaded from there before the first call)."""
import ctypes
import os

from .base import LIB, Error, check_call

__all__ = ["available", "unavailable_reason", "create_2bit", "quantize_2bit", "quantize_2bit_to", "reduce_2bit",
           "dequantize_2bit", "dequantize_2bit_add", "max_abs", "qsgd_quantize", "qsgd_decode",
           "onebit_quantize", "onebit_decode"]

_u64, _f32, _i32, _u32, _vp = ctypes.c_uint64, ctypes.c_float, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
_SIGNATURES = {
    "gp_cuda_available": [_i32],
    "gp_cuda_2bit_quantize": [_i32, _vp, _vp, _i32, _u64, _vp, _vp, _u64, _f32, _f32],
    "gp_cuda_2bit_quantize_to": [_i32, _vp, _vp, _i32, _u64, _vp, _vp, _vp, _u64, _f32, _f32],
    "gp_cuda_2bit_dequantize": [_i32, _vp, _vp, _u64, _vp, _u64, _i32],
    "gp_cuda_max_abs": [_i32, _vp, _vp, _u64, ctypes.POINTER(_f32), ctypes.POINTER(_i32)],
    "gp_cuda_qsgd_quantize": [_i32, _vp, _vp, _u64, _f32, _u32, _u64, _u64, _vp, _i32],
    "gp_cuda_qsgd_decode": [_i32, _vp, _vp, _u64, _f32, _u32, _vp],
    "gp_cuda_1bit_quantize": [_i32, _vp, _vp, _u64, _vp, _f32, _vp, _i32],
    "gp_cuda_1bit_decode": [_i32, _vp, _vp, _u64, _u32, _vp],
    "gp_cuda_pointer_device": [_vp, ctypes.POINTER(_i32)],
    "gp_cuda_2bit_reduce": [_u32, ctypes.POINTER(_i32), ctypes.POINTER(_vp), ctypes.POINTER(_vp), _i32,
                            ctypes.POINTER(_vp), _u64, _i32, _vp, _vp, _f32, _f32],
}
for _name, _args in _SIGNATURES.items():
    getattr(LIB, _name).argtypes = _args
    getattr(LIB, _name).restype = _i32

_nvrtc_tried = False


def _load_nvrtc():
    """Loads NVRTC from the PyPI wheel, when installed, under its soname, so
    that the library's own dlopen("libnvrtc.so.12") finds it."""
    global _nvrtc_tried
    if _nvrtc_tried:
        return
    _nvrtc_tried = True
    try:
        import nvidia.cuda_nvrtc as wheel
    except ImportError:
        return
    for root in list(getattr(wheel, "__path__", [])):
        path = os.path.join(root, "lib", "libnvrtc.so.12")
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


def unavailable_reason(device=0):
    """None when GPU ``device`` can run gradpack's kernels, else the reason."""
    _load_nvrtc()
    if LIB.gp_cuda_available(int(device)) == 0:
        return None
    return LIB.gp_error_last().decode("utf-8", "replace")


def available(device=0):
    return unavailable_reason(device) is None


# DLPack's C structs (dlpack.h): a borrowed view, read while the capsule lives.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_KDLCUDA = 2
_DL_CODES = {"f4": (2, 32), "f2": (2, 16), "bf2": (4, 16), "i4": (0, 32), "u8": (1, 64)}
# Gradients of the 2-bit calls: float32, float16 or bfloat16 (gp_dtype_t codes).
_GRAD = ("f4", "f2", "bf2")
_GRAD_CODE = {"f4": 0, "f2": 1, "bf2": 2}


class _View:
    """(pointer, element count, GPU, stream or None) of a GPU array; keeps
    whatever owns the memory alive while the call runs."""

    def __init__(self, obj, name, dtype, writable):
        """``dtype``: one type code, or a tuple of accepted ones (the one
        found is ``self.dtype``)."""
        self.keep = obj
        self.accepted = dtype if isinstance(dtype, tuple) else (dtype,)
        if hasattr(obj, "__cuda_array_interface__"):
            self._from_cai(obj.__cuda_array_interface__, name, dtype, writable)
        elif hasattr(obj, "__dlpack__"):
            self._from_dlpack(obj, name, dtype)
        else:
            raise Error("%s must be a GPU array (__cuda_array_interface__ or __dlpack__), got %s"
                        % (name, type(obj).__name__))

    def _from_cai(self, cai, name, dtype, writable):
        typestr = cai["typestr"]
        if typestr.lstrip("<|=") not in self.accepted:
            raise Error("%s must be %s, got typestr %r" % (name, _names(self.accepted), typestr))
        dtype = self.dtype = typestr.lstrip("<|=")
        shape = tuple(cai["shape"])
        self.n = 1
        for s in shape:
            self.n *= int(s)
        strides = cai.get("strides")
        if strides is not None and self.n > 1 and tuple(strides) != _c_strides(shape, int(dtype[-1])):
            raise Error("%s must be C-contiguous" % name)
        ptr, readonly = cai["data"]
        if writable and readonly:
            raise Error("%s is read-only; it is written" % name)
        self.ptr = int(ptr or 0)
        self.stream = cai.get("stream")
        self.device = None  # found from the pointer by the library's checks

    def _from_dlpack(self, obj, name, dtype):
        self.capsule = obj.__dlpack__()
        managed = _capsule_pointer(self.capsule, b"dltensor")
        t = _DLTensor.from_address(managed)  # DLManagedTensor starts with its DLTensor
        if t.device.device_type != _KDLCUDA:
            raise Error("%s is not on a CUDA GPU (DLPack device type %d)" % (name, t.device.device_type))
        found = [d for d in self.accepted if (t.dtype.code, t.dtype.bits, t.dtype.lanes) == _DL_CODES[d] + (1,)]
        if not found:
            raise Error("%s must be %s" % (name, _names(self.accepted)))
        self.dtype = found[0]
        bits = _DL_CODES[self.dtype][1]
        shape = tuple(t.shape[i] for i in range(t.ndim))
        self.n = 1
        for s in shape:
            self.n *= int(s)
        if t.strides and self.n > 1:
            elem_strides = tuple(t.strides[i] * (bits // 8) for i in range(t.ndim))
            if elem_strides != _c_strides(shape, bits // 8):
                raise Error("%s must be C-contiguous" % name)
        self.ptr = (t.data or 0) + t.byte_offset
        self.stream = None
        self.device = t.device.device_id


_DTYPE_NAMES = {"f4": "float32", "f2": "float16", "bf2": "bfloat16", "i4": "int32", "u8": "uint64"}


def _names(codes):
    return " or ".join(_DTYPE_NAMES[c] for c in codes)


def _c_strides(shape, itemsize):
    out, step = [], itemsize
    for s in reversed(shape):
        out.append(step)
        step *= int(s)
    return tuple(reversed(out))


def _pointer_device(v):
    """The GPU of a view: DLPack names it; for the CUDA array interface the
    driver is asked about the pointer (None when it cannot say: the call
    then reports why)."""
    if v.device is None and v.ptr and v.n:
        d = _i32()
        if LIB.gp_cuda_pointer_device(v.ptr, ctypes.byref(d)) == 0:
            v.device = d.value
    return v.device


def _device_of(views, device):
    """The one GPU every view lives on (the library checks each pointer)."""
    named = {_pointer_device(v) for v in views} - {None}
    if len(named) > 1:
        raise Error("arrays on different GPUs: %s" % sorted(named))
    if named:
        d = named.pop()
        if device is not None and device != d:
            raise Error("device=%d but the arrays are on GPU %d" % (device, d))
        return d
    return 0 if device is None else int(device)


def _stream_of(views, stream):
    if stream is not None:
        return int(stream)
    for v in views:
        if v.stream not in (None, 1):  # 1: the legacy default stream (0 here); 2 is the per-thread one
            return int(v.stream)
    return 0


def _run(fn, views, device, stream, *args):
    _load_nvrtc()
    d = _device_of(views, device)
    check_call(fn(d, _stream_of(views, stream), *args))


def create_2bit(size):
    """The compressed length for ``size`` elements (allocate it with your GPU library)."""
    return int(LIB.gp_2bit_compressed_len(int(size)))


def quantize_2bit(grad, residual, compr, neg_threshold, pos_threshold, stream=None, device=None):
    """``gradpack.nd.contrib.quantize_2bit`` on the GPU (float32, float16 or
    bfloat16 gradients; bfloat16 through DLPack): updates ``residual`` and
    writes ``compr``; on error neither is touched."""
    g, r, c = _View(grad, "grad", _GRAD, False), _View(residual, "residual", "f4", True), _View(compr, "compr", "f4", True)
    if r.n != g.n:
        raise Error("residual has %d elements, expected %d" % (r.n, g.n))
    _run(LIB.gp_cuda_2bit_quantize, [g, r, c], device, stream, g.ptr, _GRAD_CODE[g.dtype], g.n, r.ptr, c.ptr, c.n,
         neg_threshold, pos_threshold)


def quantize_2bit_to(grad, residual, next_residual, compr, neg_threshold, pos_threshold, stream=None, device=None):
    """One pass: reads ``residual``, writes ``next_residual`` and ``compr``.
    On error ``residual`` is untouched (swap the two on success)."""
    g, r = _View(grad, "grad", _GRAD, False), _View(residual, "residual", "f4", False)
    x, c = _View(next_residual, "next", "f4", True), _View(compr, "compr", "f4", True)
    for v, what in ((r, "residual"), (x, "next")):
        if v.n != g.n:
            raise Error("%s has %d elements, expected %d" % (what, v.n, g.n))
    _run(LIB.gp_cuda_2bit_quantize_to, [g, r, x, c], device, stream, g.ptr, _GRAD_CODE[g.dtype], g.n, r.ptr, x.ptr,
         c.ptr, c.n, neg_threshold, pos_threshold)


def reduce_2bit(grads, residuals, out, neg_threshold, pos_threshold, streams=None, stream=None):
    """The device store's compressed Reduce across GPUs: member ``i`` quantizes
    ``grads[i]`` with error feedback into ``residuals[i]`` on its own GPU and
    stream, and the GPU of ``out`` decodes and sums every member, in order,
    into ``out``: bit-identical to the CPU device store. On error (a
    non-finite value in any member included) nothing is written."""
    _load_nvrtc()
    if len(grads) != len(residuals) or not grads:
        raise Error("give one residual per gradient (got %d gradients, %d residuals)" % (len(grads), len(residuals)))
    gs = [_View(g, "grads[%d]" % i, _GRAD, False) for i, g in enumerate(grads)]
    if len({g.dtype for g in gs}) > 1:
        raise Error("every member's gradient must have one dtype, got %s" % sorted({g.dtype for g in gs}))
    rs = [_View(r, "residuals[%d]" % i, "f4", True) for i, r in enumerate(residuals)]
    o = _View(out, "out", "f4", True)
    for i, (g, r) in enumerate(zip(gs, rs)):
        if g.n != o.n or r.n != o.n:
            raise Error("member %d has %d and %d elements, out %d" % (i, g.n, r.n, o.n))
    devices = [_device_of([g, r], None) for g, r in zip(gs, rs)]
    ss = list(streams) if streams is not None else [_stream_of([g, r], None) for g, r in zip(gs, rs)]
    if len(ss) != len(gs):
        raise Error("give one stream per member (got %d for %d)" % (len(ss), len(gs)))
    num = len(gs)
    check_call(LIB.gp_cuda_2bit_reduce(
        num, (_i32 * num)(*devices), (_vp * num)(*[int(s) for s in ss]),
        (_vp * num)(*[g.ptr for g in gs]), _GRAD_CODE[gs[0].dtype], (_vp * num)(*[r.ptr for r in rs]), o.n,
        _device_of([o], None), _stream_of([o], stream), o.ptr, neg_threshold, pos_threshold))


def dequantize_2bit(compr, decompr, stream=None, device=None):
    """Decode ``compr`` into ``decompr`` (its size is the gradient size)."""
    c, o = _View(compr, "compr", "f4", False), _View(decompr, "decompr", "f4", True)
    _run(LIB.gp_cuda_2bit_dequantize, [c, o], device, stream, c.ptr, c.n, o.ptr, o.n, 0)


def dequantize_2bit_add(compr, out, stream=None, device=None):
    """Decode ``compr`` and add it into ``out`` (the reduce step)."""
    c, o = _View(compr, "compr", "f4", False), _View(out, "out", "f4", True)
    _run(LIB.gp_cuda_2bit_dequantize, [c, o], device, stream, c.ptr, c.n, o.ptr, o.n, 1)


def max_abs(x, stream=None, device=None):
    """``max |x|``, or None when an element is not finite."""
    v = _View(x, "x", "f4", False)
    m, finite = _f32(), _i32()
    _run(LIB.gp_cuda_max_abs, [v], device, stream, v.ptr, v.n, ctypes.byref(m), ctypes.byref(finite))
    return float(m.value) if finite.value else None


def qsgd_quantize(grad, scale, bits, seed, codes, offset=0, add=False, stream=None, device=None):
    """Max-norm QSGD codes (int32) of ``grad`` at ``scale`` >= max |grad|."""
    g, c = _View(grad, "grad", "f4", False), _View(codes, "codes", "i4", True)
    if c.n != g.n:
        raise Error("codes has %d elements, expected %d" % (c.n, g.n))
    _run(LIB.gp_cuda_qsgd_quantize, [g, c], device, stream, g.ptr, g.n, scale, bits, seed, offset, c.ptr, int(bool(add)))


def qsgd_decode(codes, scale, bits, out, stream=None, device=None):
    """``out = codes * scale / (2^bits - 1)``."""
    c, o = _View(codes, "codes", "i4", False), _View(out, "out", "f4", True)
    if c.n != o.n:
        raise Error("out has %d elements, expected %d" % (o.n, c.n))
    _run(LIB.gp_cuda_qsgd_decode, [c, o], device, stream, c.ptr, c.n, scale, bits, o.ptr)


def onebit_quantize(grad, residual, threshold, bits, add=False, stream=None, device=None):
    """1-bit quantize with error feedback: bits (int32 0/1) and ``residual`` updated."""
    g, r, b = _View(grad, "grad", "f4", False), _View(residual, "residual", "f4", True), _View(bits, "bits", "i4", True)
    for v, what in ((r, "residual"), (b, "bits")):
        if v.n != g.n:
            raise Error("%s has %d elements, expected %d" % (what, v.n, g.n))
    _run(LIB.gp_cuda_1bit_quantize, [g, r, b], device, stream, g.ptr, g.n, r.ptr, threshold, b.ptr, int(bool(add)))


def onebit_decode(counts, workers, out, stream=None, device=None):
    """``out = 2 counts - workers``."""
    c, o = _View(counts, "counts", "i4", False), _View(out, "out", "f4", True)
    if c.n != o.n:
        raise Error("out has %d elements, expected %d" % (o.n, c.n))
    _run(LIB.gp_cuda_1bit_decode, [c, o], device, stream, c.ptr, c.n, workers, o.ptr)
