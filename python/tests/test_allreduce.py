"""The MPI all-reduce store 'dist_sync_allreduce' in real processes started by
mpirun: gradpack.kv against an in-process 'device' store for every scheme,
and Gluon Trainer / Module through MXNet 1.9.1."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# Open MPI refuses root without these; --oversubscribe allows more ranks than cores.
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


def mpirun(n, script, args, tmp_path, timeout=240, per_rank=None, **env):
    """Runs `script` on `n` ranks; with `per_rank`, rank i's process also gets
    the variables per_rank[i] (one app context each: GRADPACK_KERNEL caps its
    kernels, RAYON_NUM_THREADS sets its threads)."""
    env = dict(os.environ, GRADPACK_TEST_OUT=str(tmp_path), **env)
    command = [sys.executable, os.path.join(HERE, "dist_scripts", script)] + args
    if per_rank is None:
        argv = MPIRUN + ["-n", str(n)] + command
    else:
        assert len(per_rank) == n
        argv = list(MPIRUN)
        for i, variables in enumerate(per_rank):
            argv += ([":"] if i else []) + ["-n", "1"] + sum((["-x", "%s=%s" % kv] for kv in variables.items()), []) + command
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-4000:])
    results = []
    for rank in range(n):
        with open(str(tmp_path / ("rank%d.json" % rank))) as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("workers", [2, 4])
def test_every_scheme_matches_the_device_store(tmp_path, workers):
    for res in mpirun(workers, "allreduce_kv.py", [], tmp_path):
        assert res["workers"] == workers
        for name, s in res["schemes"].items():
            # quantized codes are summed exactly; float32 sums (none, powersgd) up to rounding
            limit = 1e-5 if name in ("none", "powersgd") else 0.0
            assert s["max_diff"] <= limit, (name, s)
            if name not in ("none", "powersgd"):
                assert s["wire"] * 3 < s["raw"], (name, s)
        assert res["schemes"]["none"]["wire"] == res["schemes"]["none"]["raw"]
        assert "'bits': 'qsgd_mn_ts' takes two values" in res["bad_params"]
        # PowerSGD after a zero first push and a spike: the device store's rule, alive after step 0
        for case in ("zero_first", "spike", "overflow"):
            s = res["powersgd " + case]
            assert s["max_diff"] <= 1e-5 and all(m > 0.1 for m in s["max_abs"][1:]), (case, s)
        # a P sum past float32: the same error on every rank and on the device store
        errors = res["powersgd overflow errors"]
        assert len(errors) == 2 and all(e and "sum of P holds" in e for e in errors), errors


def test_ranks_on_different_kernels_and_threads_give_the_device_stores_bits(tmp_path):
    # Machines differ: rank 0 runs the portable scheme and codec kernels on
    # one thread, rank 1 the widest this CPU has on two, on 40 x 4000
    # keys (several parallel pieces). Each rank's device store quantizes,
    # selects and decodes every rank's push with its own kernels and
    # threads, so one bit of difference between them shows on a rank.
    # (mpirun binds each rank to a core: rank 1's threads are asked for.)
    per_rank = [{"GRADPACK_KERNEL": "portable", "RAYON_NUM_THREADS": "1"}, {"GRADPACK_KERNEL": "avx512", "RAYON_NUM_THREADS": "2"}]
    results = mpirun(2, "allreduce_kv.py", [], tmp_path, per_rank=per_rank, GRADPACK_TEST_SHAPE="40,4000")
    for res in results:
        for name, s in res["schemes"].items():
            limit = 1e-5 if name in ("none", "powersgd") else 0.0
            assert s["max_diff"] <= limit, (name, s)
    assert results[0]["scheme_kernel"] == "portable" and results[1]["scheme_kernel"] != "portable", results
    assert results[0]["codec_kernel"] == "portable", results


@pytest.mark.parametrize("api", ["trainer", "module"])
@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_trainer_and_module_with_two_bit(tmp_path, api, update_on_kvstore):
    from mxnet_required import mxnet
    mxnet()
    results = mpirun(2, "mxnet_train.py", [api, "1" if update_on_kvstore else "0", "dist_sync_allreduce"], tmp_path)
    for res in results:
        # each worker: 0.3 -> nothing, 0.6 -> sends 0.5, 0.4 -> nothing, 0.7 -> 0.5; summed over 2 workers
        assert res["weights"] == [[1.0] * 4, [0.0] * 4, [0.0] * 4, [-1.0] * 4], res
        assert 0 < res["stats"]["wire_bytes"] < res["stats"]["raw_bytes"]


def test_a_dead_worker_ends_the_job(tmp_path):
    # The timeout only turns a hang into a failure; the events are what is checked.
    out = subprocess.run(MPIRUN + ["-n", "2", sys.executable, os.path.join(HERE, "dist_scripts", "allreduce_dead.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Exit code:    3" in out.stderr + out.stdout, out.stderr[-2000:]
    assert "push returned" not in out.stdout


def test_a_worker_that_ends_without_close_does_not_leave_another_waiting(tmp_path):
    """Rank 1 ends its script (no close()) while rank 0 pushes once more: the
    store closes collectively at exit, so rank 0 gets an error naming the
    reason instead of waiting forever, and the job ends 0."""
    results = mpirun(2, "allreduce_exit.py", [], tmp_path, timeout=120)
    assert [r["value"] for r in results] == [[2.0] * 4, [2.0] * 4]
    assert "another worker closed its store" in results[0]["extra"], results[0]


def test_a_call_one_rank_refuses_before_its_store_fails_on_every_rank(tmp_path):
    """Rank 1's front (gradpack.kv, the MXNet plugin) or store refuses a call
    before the agreement: both ranks' call fails, naming rank 1's cause, and
    the next call pairs with the next (it took rank 1's next gradient)."""
    from mxnet_required import mxnet
    mxnet()
    results = mpirun(2, "allreduce_refusals.py", [], tmp_path, timeout=120)
    causes = {"float64": "dtype float64", "output shape": "has shape [5]", "strided output": "C-contiguous",
              "init list": "init takes one value, got 2", "mxnet numpy": "must be an NDArray"}
    for res in results:
        for name, cause in causes.items():
            err = res[name]
            assert err is not None and cause in err, (res["rank"], name, err)
            if res["rank"] == 0:
                assert "workers disagree" in err and "worker rank 1: " in err, (name, err)
            assert res[name + " then"] == [21.0] * 4, (res["rank"], name, res[name + " then"])
        assert "not initialized" in res["key 7"], res["key 7"]


def open_store(**env):
    code = ("import gradpack, gradpack.kv\n"
            "try:\n    gradpack.kv.create('dist_sync_allreduce')\n    print('opened')\n"
            "except gradpack.Error as e:\n    print('error:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_open_mpi_is_found_at_run_time_beside_mpirun_or_named():
    """Open MPI is loaded when the store opens: a library given by name that
    is missing, or is not Open MPI, is refused with an error naming it."""
    missing = open_store(GRADPACK_MPI_LIBRARY="/nonexistent/libmpi.so.40")
    assert missing.startswith("error: 'dist_sync_allreduce' found no Open MPI to load (tried /nonexistent/libmpi.so.40"), missing
    assert "GRADPACK_MPI_LIBRARY" in missing and "openmpi-bin" in missing, missing
    import ctypes.util
    other = "/lib/x86_64-linux-gnu/" + ctypes.util.find_library("z")  # a real library, not MPI
    refused = open_store(GRADPACK_MPI_LIBRARY=other)
    assert refused.startswith("error: %s is not an Open MPI library gradpack can use: it has no symbol "
                              "MPI_Get_library_version" % other), refused
    # Found beside the mpirun on PATH (Debian: /usr/bin/orterun, whose libmpi
    # is the loader's): one process is a singleton job of one rank.
    assert open_store() == "opened"


def test_the_libmpi_of_the_mpirun_on_path_comes_first(tmp_path):
    """An Open MPI under its own prefix: <prefix>/bin/mpirun on PATH makes
    <prefix>/lib/libmpi.so.40 the one loaded (here a stand-in that is not
    MPI, so the refusal names which file was taken)."""
    import ctypes.util
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin" / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "mpirun").chmod(0o755)
    os.symlink("/lib/x86_64-linux-gnu/" + ctypes.util.find_library("z"), str(tmp_path / "lib" / "libmpi.so.40"))
    got = open_store(PATH="%s:%s" % (tmp_path / "bin", os.environ["PATH"]))
    assert got.startswith("error: %s is not an Open MPI library" % (tmp_path / "lib" / "libmpi.so.40")), got
