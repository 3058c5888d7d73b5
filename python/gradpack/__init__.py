"""gradpack: gradient compression for distributed training, with MXNet's API.

``gradpack.nd.contrib`` holds the 2-bit operators on numpy arrays;
``import gradpack.mxnet`` registers them into a real MXNet."""
from .base import Error, kernel_name, scheme_kernel_name, version
from . import kv, nd

__version__ = version()
__all__ = ["Error", "kv", "nd", "kernel_name", "scheme_kernel_name", "__version__"]
