#!/usr/bin/env bash
# Installs a built wheel (default: the one in dist/) into a new venv, with
# cargo and rustc off PATH and nothing of this checkout importable, and runs
# python/tests/wheel_smoke.py there: the operators (numpy and MXNet), the
# device store, the MPI store's message, and a 2-worker parameter-server job
# under gradpack.launch. scripts/test.sh runs it after scripts/wheel.sh.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
wheel=${1:-$(ls "$root"/dist/gradpack-*.whl)}
venv="$root/target/wheel/smoke-venv"
work="$root/target/wheel/smoke-work"
rm -rf "$venv" "$work"
mkdir -p "$work"

# PATH without any directory that holds cargo or rustc.
clean_path=
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  [ -e "$d/cargo" ] || [ -e "$d/rustc" ] || clean_path=${clean_path:+$clean_path:}$d
done

python3 -m venv "$venv"
"$venv/bin/pip" install -q "gradpack[mxnet] @ file://$wheel"
cp "$root/python/tests/wheel_smoke.py" "$work/"
cd "$work"  # nothing of the checkout on sys.path
env -u PYTHONPATH -u GRADPACK_LIBRARY -u LD_LIBRARY_PATH -u VIRTUAL_ENV PATH="$venv/bin:$clean_path" \
  "$venv/bin/python" wheel_smoke.py
