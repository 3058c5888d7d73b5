"""Loading the native library and converting its errors: the one place where
gradpack's C ABI meets Python."""
import ctypes
import glob
import os

import numpy as np

__all__ = ["Error", "check_call", "lib_path", "LIB", "DTYPES", "NativeHandle"]

# numpy dtype name -> gp_dtype_t (c_api.h; python/tests/test_c_api.py checks it)
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


class Error(ValueError):
    """Bad input to gradpack: the message names what is wrong. Outputs are untouched."""


class NativeHandle(object):
    """A base for every class whose instances own a handle from LIB (freed
    when the instance is dropped): copying such an object would share the
    handle and free it twice, and a handle cannot travel to another process,
    so copy.copy, copy.deepcopy and pickling are refused with an Error that
    names the class and, in ``_instead``, what to use instead."""

    _instead = "create a new one"

    def _describe(self):
        return "%s.%s" % (type(self).__module__, type(self).__name__)

    def _refuse(self, what):
        raise Error("a %s cannot be %s: it owns native state that copies would share and free twice; %s"
                    % (self._describe(), what, self._instead))

    def __copy__(self):
        self._refuse("copied (copy.copy)")

    def __deepcopy__(self, memo):
        self._refuse("copied (copy.deepcopy)")

    def __reduce_ex__(self, protocol):
        self._refuse("pickled")

    def __reduce__(self):
        self._refuse("pickled")


def _find_library():
    explicit = os.environ.get("GRADPACK_LIBRARY")
    if explicit:
        return os.path.abspath(explicit)
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_native*.so")))
    if not found:
        raise ImportError(
            "gradpack's native library is missing from %s: install the package with "
            "`pip install .` from the repository root, or set GRADPACK_LIBRARY to a built "
            "libgradpack.so" % here)
    return found[0]


lib_path = _find_library()
LIB = ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)

_u64 = ctypes.c_uint64
_f32p = ctypes.POINTER(ctypes.c_float)
LIB.gp_error_last.restype = ctypes.c_char_p
LIB.gp_version.restype = ctypes.c_char_p
LIB.gp_kernel_name.restype = ctypes.c_char_p
LIB.gp_scheme_kernel_name.restype = ctypes.c_char_p
LIB.gp_2bit_compressed_len.restype = _u64
LIB.gp_2bit_compressed_len.argtypes = [_u64]
LIB.gp_2bit_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int, _u64, ctypes.c_void_p, _u64,
                                 ctypes.c_void_p, _u64, ctypes.c_float, ctypes.c_float]
LIB.gp_2bit_dequantize.argtypes = [ctypes.c_void_p, _u64, ctypes.c_void_p, _u64]
LIB.gp_2bit_dequantize_add.argtypes = [ctypes.c_void_p, _u64, ctypes.c_void_p, _u64]


def check_call(status):
    """Raise Error with the library's message when a C call failed."""
    if status != 0:
        raise Error(LIB.gp_error_last().decode("utf-8", "replace"))


def version():
    return LIB.gp_version().decode()


def kernel_name():
    """The codec kernel chosen for this CPU: 'avx2' or 'portable'."""
    return LIB.gp_kernel_name().decode()


def scheme_kernel_name():
    """The instruction set the scheme kernels (QSGD, random-K, 1-bit,
    PowerSGD) run on this CPU: 'portable', 'avx2' or 'avx512', capped by
    $GRADPACK_KERNEL when first used. Every one gives the same bits."""
    return LIB.gp_scheme_kernel_name().decode()
