# Sourced by scripts/demo.sh and scripts/test.sh: makes sure .venv exists with
# what gradpack needs (MXNet 1.9.1 wants numpy<1.24), then installs gradpack
# itself into it from this checkout (cargo keeps target/ between runs).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# Open MPI (the all-reduce store) and libclang (the mpi crate's bindgen) come
# from Debian; installed here when missing and we may (root with apt-get).
missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin)
[ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || [ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || missing+=(libopenmpi-dev)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || missing+=(libclang-dev)
command -v pkg-config >/dev/null || missing+=(pkg-config)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  else
    echo "gradpack needs: ${missing[*]} (Debian packages)" >&2
    exit 1
  fi
fi
venv="$root/.venv"
stamp="$venv/.gradpack-deps-1"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ]; then
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q 'numpy<1.24' 'mxnet==1.9.1' ml_dtypes pytest 'setuptools>=64' \
    'setuptools-rust>=1.7' wheel scikit-learn
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
export PYTHON="$venv/bin/python"
# gradpack with its MXNet operator library (mxnet is importable in the venv)
# and the MPI all-reduce store.
PYTHONWARNINGS=ignore GRADPACK_MXNET=1 GRADPACK_MPI=1 "$venv/bin/pip" install -q --no-build-isolation --no-deps "$root"
