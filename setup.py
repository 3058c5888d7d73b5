"""Builds the Rust core (a cdylib loaded with ctypes) into the gradpack package.

When the target Python can import mxnet, the library also carries gradpack's
MXNet operator library (Cargo feature `mxnet`). GRADPACK_MXNET=0/1 overrides
the detection. GRADPACK_MPI=0/1 does the same for the MPI all-reduce store
(Cargo feature `mpi`, needs Open MPI's headers). GRADPACK_CUDA=0 leaves out
the CUDA kernels (Cargo feature `cuda`, on by default: it needs no CUDA
toolkit to build, and loads the driver and NVRTC only when a GPU is used)."""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools_rust import Binding, RustExtension


def target_mxnet_dir():
    """The mxnet package directory of the interpreter we build for, or None.

    Under pip's build isolation our own sys.path hides the target environment's
    packages, so ask a fresh interpreter without pip's isolation variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    probe = ("import importlib.util, os; s = importlib.util.find_spec('mxnet'); "
             "print(os.path.dirname(s.origin) if s else '')")
    try:
        out = subprocess.run([sys.executable, "-S", "-c", "import site; site.main(); " + probe],
                             env=env, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


features = []
choice = os.environ.get("GRADPACK_MXNET", "auto")
if choice != "0":
    mxnet_dir = os.environ.get("GRADPACK_MXNET_DIR") or target_mxnet_dir()
    if mxnet_dir:
        os.environ["GRADPACK_MXNET_DIR"] = mxnet_dir
        features.append("mxnet")
    elif choice == "1":
        sys.exit("GRADPACK_MXNET=1 but mxnet is not importable by %s" % sys.executable)

# The MPI all-reduce store: GRADPACK_MPI=1 (or auto: when mpicc is on PATH).
mpi_choice = os.environ.get("GRADPACK_MPI", "auto")
if mpi_choice == "1" or (mpi_choice == "auto" and shutil.which("mpicc")):
    features.append("mpi")

if os.environ.get("GRADPACK_CUDA", "1") != "0":
    features.append("cuda")

setup(
    rust_extensions=[
        RustExtension("gradpack._native", path="Cargo.toml", binding=Binding.NoBinding,
                      features=features, py_limited_api=False)
    ],
    zip_safe=False,
)
