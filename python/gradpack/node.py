"""Run a distributed job's scheduler or server from MXNet's launch variables:

    DMLC_ROLE=server DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9091 \\
    DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 python -m gradpack.node

Exits 0 when the job ends, 1 when it fails (see gradpack::store::param_server::config for
every variable)."""
import os
import sys

from .kv import serve_and_exit


def main():
    role = os.environ.get("DMLC_ROLE", "").strip()
    if role not in ("server", "scheduler"):
        sys.exit("gradpack.node: DMLC_ROLE must be 'server' or 'scheduler', got %r" % (role,))
    serve_and_exit()


if __name__ == "__main__":
    main()
