"""The 2-bit operators of MXNet's compression proposal on numpy arrays, in place
and zero-copy: ``create_2bit``, ``quantize_2bit``, ``dequantize_2bit``."""
import numpy as np

from ..base import DTYPES, LIB, Error, check_call

__all__ = ["create_2bit", "quantize_2bit", "dequantize_2bit", "dequantize_2bit_add"]



def _check_array(arr, name, writable=False, dtypes=("float32",)):
    if not isinstance(arr, np.ndarray):
        raise Error("%s must be a numpy.ndarray, got %s" % (name, type(arr).__name__))
    if arr.dtype.name not in dtypes:
        raise Error("%s has dtype %s, expected %s" % (name, arr.dtype.name, " or ".join(dtypes)))
    if not arr.flags.c_contiguous:
        raise Error("%s must be C-contiguous" % name)
    if writable and not arr.flags.writeable:
        raise Error("%s is read-only; it is written in place" % name)
    return arr.ctypes.data, arr.size


def _thresholds(neg_threshold, pos_threshold):
    try:
        neg, pos = float(neg_threshold), float(pos_threshold)
    except (TypeError, ValueError):
        raise Error("thresholds must be numbers, got neg_threshold=%r pos_threshold=%r"
                    % (neg_threshold, pos_threshold)) from None
    return neg, pos


def create_2bit(grad):
    """A zero-filled float32 array of ``3 + ceil(grad.size / 16)`` elements."""
    size = grad.size if hasattr(grad, "size") else int(grad)
    return np.zeros(int(LIB.gp_2bit_compressed_len(size)), dtype=np.float32)


def quantize_2bit(grad, residual, compr, neg_threshold, pos_threshold):
    """Quantize ``grad`` (float32, float16 or bfloat16) with error feedback.

    Updates ``residual`` (float32, same size) and writes ``compr`` (from
    ``create_2bit``) in place. On error neither is touched."""
    g, n = _check_array(grad, "grad", dtypes=tuple(DTYPES))
    r, rn = _check_array(residual, "residual", writable=True)
    c, cn = _check_array(compr, "compr", writable=True)
    neg, pos = _thresholds(neg_threshold, pos_threshold)
    check_call(LIB.gp_2bit_quantize(g, DTYPES[grad.dtype.name], n, r, rn, c, cn, neg, pos))


def dequantize_2bit(compr, decompr):
    """Decode ``compr`` into ``decompr`` (float32; its size is the gradient size)."""
    c, cn = _check_array(compr, "compr")
    o, n = _check_array(decompr, "decompr", writable=True)
    check_call(LIB.gp_2bit_dequantize(c, cn, o, n))


def dequantize_2bit_add(compr, out):
    """Decode ``compr`` and add it into ``out`` (the reduce step)."""
    c, cn = _check_array(compr, "compr")
    o, n = _check_array(out, "out", writable=True)
    check_call(LIB.gp_2bit_dequantize_add(c, cn, o, n))
