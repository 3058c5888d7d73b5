"""Gluon Trainer and Module on gradpack's dist_sync store with compress_params,
2 worker processes with one context each: MXNet 1.9.1's own dist store fails
here ("Compression not supported with PushPull"); gradpack must not."""
import json
import os
import subprocess
import sys

import pytest

from mxnet_required import mxnet

mxnet()
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("api", ["trainer", "module"])
@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_dist_sync_two_bit_weights(tmp_path, api, update_on_kvstore):
    env = dict(os.environ, GRADPACK_TEST_OUT=str(tmp_path), PS_HEARTBEAT_TIMEOUT="20")
    out = subprocess.run([sys.executable, "-m", "gradpack.launch", "-n", "2", "-s", "1", "--timeout", "240",
                          sys.executable, os.path.join(HERE, "dist_scripts", "mxnet_train.py"), api,
                          "1" if update_on_kvstore else "0"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            res = json.load(f)
        # each worker: 0.3 -> nothing, 0.6 -> sends 0.5, 0.4 -> nothing, 0.7 -> 0.5;
        # the servers sum 2 workers' 0.5 = 1; SGD lr 1
        assert res["weights"] == [[1.0] * 4, [0.0] * 4, [0.0] * 4, [-1.0] * 4], res
        assert res["stats"]["bytes_sent"] > 0


@pytest.mark.parametrize("api,update_on_kvstore", [("trainer", "none"), ("trainer", "1"), ("module", "1")])
def test_optimizers_the_servers_cannot_run_update_on_the_workers(tmp_path, api, update_on_kvstore):
    """A Python subclass of SGD: the Trainer left to choose updates on the
    workers through MXNet's own path; asked to update on the store (Trainer
    or Module), the store sums on the servers and runs MXNet's updater on
    each worker. The weights are SGD's, exactly."""
    env = dict(os.environ, GRADPACK_TEST_OUT=str(tmp_path), PS_HEARTBEAT_TIMEOUT="20",
               GRADPACK_TEST_OPTIMIZER="pysgd")
    out = subprocess.run([sys.executable, "-m", "gradpack.launch", "-n", "2", "-s", "1", "--timeout", "240",
                          sys.executable, os.path.join(HERE, "dist_scripts", "mxnet_train.py"), api,
                          update_on_kvstore], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            res = json.load(f)
        assert res["weights"] == [[1.0] * 4, [0.0] * 4, [0.0] * 4, [-1.0] * 4], res
        assert res["update_on_kvstore"] == (update_on_kvstore == "1"), res
        assert res["worker_updates"] == (update_on_kvstore == "1"), res


@pytest.mark.parametrize("api", ["trainer", "module"])
def test_dist_sync_qsgd_weights(tmp_path, api):
    """qsgd_mn through Trainer / Module: 2 workers push 0.3 each; scale 0.3 and
    3 levels make every code 3, so the servers decode exactly 6 * 0.3 / 3."""
    import numpy as np
    env = dict(os.environ, GRADPACK_TEST_OUT=str(tmp_path), PS_HEARTBEAT_TIMEOUT="20",
               GRADPACK_TEST_PARAMS=json.dumps({"compress": "qsgd_mn", "bits": 2}))
    out = subprocess.run([sys.executable, "-m", "gradpack.launch", "-n", "2", "-s", "1", "--timeout", "240",
                          sys.executable, os.path.join(HERE, "dist_scripts", "mxnet_train.py"), api, "1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    step = np.float32(np.float64(6) * np.float64(np.float32(0.3)) / 3)
    want, w = [], np.float32(1)
    for _ in range(4):
        w = np.float32(w - step)
        want.append([float(w)] * 4)
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            assert json.load(f)["weights"] == want


def test_row_sparse_keys_on_dist_sync_are_held_dense(tmp_path):
    """row_sparse init, push and row_sparse_pull through MXNet's API on
    gradpack's servers: the values MXNet gives (rows 0 and 1 summed from
    the two workers, row 5 untouched), kept dense on the wire."""
    env = dict(os.environ, GRADPACK_TEST_OUT=str(tmp_path), PS_HEARTBEAT_TIMEOUT="20")
    out = subprocess.run([sys.executable, "-m", "gradpack.launch", "-n", "2", "-s", "1", "--timeout", "240",
                          sys.executable, os.path.join(HERE, "dist_scripts", "mxnet_sparse.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    want = [[1.0] * 3, [2.0] * 3, [0.0] * 3, [0.0] * 3, [0.0] * 3, [0.0] * 3]
    for rank in range(2):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            res = json.load(f)
        assert res == {"stype": "row_sparse", "rows": want}, res
