# Set-up shared by scripts/demo.sh and scripts/test.sh (they source it): the
# Debian packages the build needs, then .venv with what gradpack needs (MXNet
# 1.9.1 wants numpy<1.24), then gradpack itself from this checkout (cargo keeps
# target/ between runs).
#
# Each Debian dependency is decided by asking dpkg about its package, never by
# looking for files (a loose glob once took another package's file for the
# one the build needed, and never installed it).
#
#   bash scripts/env.sh --check   prints each dependency, the file the build
#                                 uses from it and what dpkg says, and fails
#                                 unless dpkg and the file agree that it is
#                                 installed (scripts/test.sh runs it).
#
# GRADPACK_SYSROOT (a directory prefixed to every file probe) and
# GRADPACK_DPKG_QUERY (a dpkg-query stand-in) exist for the test of --check
# (python/tests/test_env_setup.py); leave them unset otherwise.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

gp_sysroot=${GRADPACK_SYSROOT:-}
gp_dpkg_query=${GRADPACK_DPKG_QUERY:-dpkg-query}
gp_multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)

# package | why the build needs it | the file the build uses from it
gp_deps=(
  "openmpi-bin|mpirun, which runs the MPI all-reduce store's tests|/usr/bin/mpirun.openmpi"
  "libopenmpi3|libmpi.so.40, which the all-reduce store loads at run time|/usr/lib/$gp_multiarch/libmpi.so.40"
)

# Prints dpkg's status line for a package ("install ok installed" when it is).
gp_dpkg_status() {
  "$gp_dpkg_query" -W -f='${Status}' "$1" 2>/dev/null || echo "not known to dpkg"
}

# Prints the exact file the build would use, or nothing. Only the LLVM version
# directory is a pattern: the file name itself is matched exactly.
gp_find_file() {
  local path
  for path in $gp_sysroot$1; do
    [ -e "$path" ] && { echo "$path"; return; }
  done
  return 0
}

gp_check() {
  local dep pkg why pattern status file verdict failed=0
  for dep in "${gp_deps[@]}"; do
    IFS='|' read -r pkg why pattern <<<"$dep"
    status=$(gp_dpkg_status "$pkg")
    file=$(gp_find_file "$pattern")
    if [ "$status" = "install ok installed" ] && [ -n "$file" ]; then
      verdict=ok
    elif [ "$status" = "install ok installed" ]; then
      verdict="DISAGREE: dpkg says installed, but $pattern is missing"; failed=1
    elif [ -n "$file" ]; then
      verdict="DISAGREE: $file exists, but dpkg says '$status'"; failed=1
    else
      verdict="MISSING: run scripts/env.sh as root to install it"; failed=1
    fi
    printf '%-15s file %s: %s | dpkg: %s | %s\n' "$pkg" "$pattern" "${file:-absent}" "$status" "$verdict"
  done
  if [ "$failed" != 0 ]; then
    echo "env.sh --check: the set-up's dependencies and dpkg disagree (see above)" >&2
    return 1
  fi
  echo "env.sh --check: every dependency is installed, by dpkg and by file"
}

if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = "--check" ]; then
  gp_check
  exit $?
fi

gp_missing=()
for gp_dep in "${gp_deps[@]}"; do
  IFS='|' read -r gp_pkg gp_why _ <<<"$gp_dep"
  gp_status=$(gp_dpkg_status "$gp_pkg")
  if [ "$gp_status" != "install ok installed" ]; then
    echo "env.sh: installing $gp_pkg (dpkg: $gp_status): $gp_why"
    gp_missing+=("$gp_pkg")
  fi
done
if [ ${#gp_missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${gp_missing[@]}"
  else
    echo "gradpack needs these Debian packages: ${gp_missing[*]} (run as root, or install them)" >&2
    exit 1
  fi
fi

venv="$root/.venv"
source "$root/scripts/venv.sh"
# nvidia-cuda-nvrtc-cu12: NVRTC, which compiles the CUDA kernels (no GPU needed).
# torch: gradpack.torch's DDP hooks (PyPI has only its CUDA build, about 3 GB
# with its nvidia-* wheels; it runs gloo on a machine without a GPU).
gp_venv "$venv" .gradpack-deps-3 'numpy<1.24' 'mxnet==1.9.1' ml_dtypes pytest 'setuptools>=64' \
  'setuptools-rust>=1.7' wheel scikit-learn 'nvidia-cuda-nvrtc-cu12==12.9.86' 'torch==2.15.0'
export PATH="$venv/bin:$PATH"
export PYTHON="$venv/bin/python"
# NVRTC from the wheel, for the Rust tests of the CUDA kernels (Python loads it itself).
gp_nvrtc_dir=$("$PYTHON" -c 'import os, nvidia.cuda_nvrtc as m; print(os.path.join(list(m.__path__)[0], "lib"))')
export LD_LIBRARY_PATH="$gp_nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# gradpack with its MXNet operator library (mxnet is importable in the venv)
# and the MPI all-reduce store.
PYTHONWARNINGS=ignore GRADPACK_MXNET=1 GRADPACK_MPI=1 "$venv/bin/pip" install -q --no-build-isolation --no-deps "$root"
