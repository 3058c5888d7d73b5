"""gradpack's 2-bit operators inside MXNet: loads the operator library with
``mx.library.load``, after which the proposal's operators work on NDArrays::

    mx.nd.contrib.create_2bit(grad)
    mx.nd.contrib.quantize_2bit(grad, residual, compr, neg_threshold=-0.5, pos_threshold=0.5)
    mx.nd.contrib.quantize_2bit(grad, residual, compr, -0.5, 0.5)   # positional form
    mx.nd.contrib.dequantize_2bit(compr, decompr)

quantize and dequantize mutate their inputs in place (no copies) and have no
outputs, so they are imperative only: the ``mx.sym`` spellings raise an error
instead of crashing MXNet. Operator errors raise ``OperatorError``, which is
both a ``gradpack.Error`` and an ``mx.base.MXNetError``.
"""
import re

import mxnet as mx

from ..base import LIB, Error, lib_path

__all__ = ["OperatorError"]


class OperatorError(Error, mx.base.MXNetError):
    """An error from one of gradpack's MXNet operators."""


def _has_operator_library():
    try:
        getattr(LIB, "_opRegSize")
        return True
    except AttributeError:
        return False


if not _has_operator_library():
    raise ImportError(
        "gradpack was built without its MXNet operator library (%s). Install mxnet==1.9.1 "
        "first, then reinstall gradpack: `pip install .` builds the library with MXNet "
        "support when mxnet is importable." % lib_path)

mx.library.load(lib_path, False)

_OPS = ("create_2bit", "quantize_2bit", "dequantize_2bit")
_native = {name: getattr(mx.nd.contrib, name) for name in _OPS}
_TRACE_ENTRY = re.compile(r"^\s*\[\d+\] [^\n]*?\]: (.*)$", re.M)


def _raise_clean(err):
    """Re-raise an MXNetError from our library with only our (last) message.

    lib_api keeps every message it ever logged; the newest one is ours."""
    found = _TRACE_ENTRY.findall(str(err))
    raise OperatorError(found[-1] if found else str(err)) from None


def create_2bit(grad, **kwargs):
    """A zero-filled float32 NDArray of ``3 + ceil(grad.size / 16)`` elements."""
    try:
        return _native["create_2bit"](grad, **kwargs)
    except mx.base.MXNetError as e:
        _raise_clean(e)


def quantize_2bit(grad, residual, compr, neg_threshold=None, pos_threshold=None, **kwargs):
    """Quantize ``grad`` into ``compr`` with error feedback in ``residual`` (both
    mutated in place). Thresholds by keyword or position, as in the proposal."""
    if neg_threshold is None or pos_threshold is None:
        raise OperatorError("quantize_2bit needs neg_threshold and pos_threshold")
    try:
        _native["quantize_2bit"](grad, residual, compr, neg_threshold=neg_threshold,
                                 pos_threshold=pos_threshold, **kwargs)
    except mx.base.MXNetError as e:
        _raise_clean(e)


def dequantize_2bit(compr, decompr, **kwargs):
    """Decode ``compr`` into ``decompr`` in place. Waits for the result so that a
    corrupt input raises here, naming the problem, with ``decompr`` untouched."""
    try:
        _native["dequantize_2bit"](compr, decompr, **kwargs)
        decompr.wait_to_read()
    except mx.base.MXNetError as e:
        _raise_clean(e)


def _imperative_only(name):
    def refuse(*args, **kwargs):
        raise OperatorError(
            "%s mutates its inputs in place and has no outputs, so it has no symbolic form; "
            "call mx.nd.contrib.%s on NDArrays" % (name, name))
    refuse.__name__ = name
    return refuse


def _install_operators():
    import mxnet.contrib  # noqa: F401  (mx.contrib.nd / mx.contrib.sym)
    imperative = {"create_2bit": create_2bit, "quantize_2bit": quantize_2bit,
                  "dequantize_2bit": dequantize_2bit}
    for module in (mx.nd.contrib, mx.contrib.nd):
        for name, fn in imperative.items():
            setattr(module, name, fn)
    for module in (mx.sym.contrib, mx.contrib.sym):
        for name in ("quantize_2bit", "dequantize_2bit"):
            setattr(module, name, _imperative_only(name))


_install_operators()
