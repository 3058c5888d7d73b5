"""Builds the Rust core (a cdylib loaded with ctypes) into the gradpack package.

When the target Python can import mxnet, the library also carries gradpack's
MXNet operator library (Cargo feature `mxnet`). GRADPACK_MXNET=0/1 overrides
the detection. GRADPACK_MPI=0 leaves out the MPI all-reduce store (Cargo
feature `mpi`, on by default: it needs nothing to build, and loads Open MPI
at run time). GRADPACK_CUDA=0 leaves out
the CUDA kernels (Cargo feature `cuda`, on by default: it needs no CUDA
toolkit to build, and loads the driver and NVRTC only when a GPU is used).

GRADPACK_PREBUILT_LIBRARY=path packs a library built beforehand (by
scripts/wheel.sh) as gradpack/_native.so instead of building one, in a wheel
tagged py3-none-<platform>: the library is loaded with ctypes, so one wheel
serves every Python 3.

Either way the package installs gradpack-startup.pth beside itself in
site-packages: the opt-in start-up hook (python/gradpack/_startup.py)."""
import os
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py


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


HOOK = "gradpack-startup.pth"
PREBUILT = os.environ.get("GRADPACK_PREBUILT_LIBRARY")


class build_py_with_hook(build_py):
    """Adds the start-up hook at the top of site-packages (a .pth file must
    sit there to be read) and, in a prebuilt build, the native library."""

    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        self.copy_file(os.path.join(here, "python", HOOK), os.path.join(self.build_lib, HOOK))
        if PREBUILT:
            self.copy_file(PREBUILT, os.path.join(self.build_lib, "gradpack", "_native.so"))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, HOOK)]


def build_from_source():
    """setuptools-rust builds the library with the features chosen below."""
    from setuptools_rust import Binding, RustExtension

    features = []
    choice = os.environ.get("GRADPACK_MXNET", "auto")
    if choice != "0":
        mxnet_dir = os.environ.get("GRADPACK_MXNET_DIR") or target_mxnet_dir()
        if mxnet_dir:
            os.environ["GRADPACK_MXNET_DIR"] = mxnet_dir
            features.append("mxnet")
        elif choice == "1":
            sys.exit("GRADPACK_MXNET=1 but mxnet is not importable by %s" % sys.executable)

    if os.environ.get("GRADPACK_MPI", "1") != "0":
        features.append("mpi")

    if os.environ.get("GRADPACK_CUDA", "1") != "0":
        features.append("cuda")

    setup(
        cmdclass={"build_py": build_py_with_hook},
        rust_extensions=[
            RustExtension("gradpack._native", path="Cargo.toml", binding=Binding.NoBinding,
                          features=features, py_limited_api=False)
        ],
        zip_safe=False,
    )


if PREBUILT:
    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:  # setuptools < 70.1
        from wheel.bdist_wheel import bdist_wheel

    class BinaryDistribution(Distribution):
        def has_ext_modules(self):
            return True  # a platform wheel: it carries a native library

    class bdist_wheel_any_python(bdist_wheel):
        def get_tag(self):
            return ("py3", "none", super().get_tag()[2])

    if not os.path.isfile(PREBUILT):
        sys.exit("GRADPACK_PREBUILT_LIBRARY=%s: no such file" % PREBUILT)
    setup(cmdclass={"build_py": build_py_with_hook, "bdist_wheel": bdist_wheel_any_python},
          distclass=BinaryDistribution, zip_safe=False)
else:
    build_from_source()
