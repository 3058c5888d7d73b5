# gp_venv DIR STAMP PIP_ARGS...: makes DIR a venv (python3 -m venv) and, once,
# upgrades its pip and installs PIP_ARGS; the file DIR/STAMP marks that done
# (change the stamp's name to install again). Sourced by env.sh and wheel.sh.
gp_venv() {
  local dir=$1 stamp=$2
  shift 2
  if [ ! -x "$dir/bin/python" ]; then
    python3 -m venv "$dir"
  fi
  if [ ! -f "$dir/$stamp" ]; then
    "$dir/bin/pip" install -q --upgrade pip
    "$dir/bin/pip" install -q "$@"
    touch "$dir/$stamp"
  fi
}
