"""The smoke test of an installed wheel (scripts/wheel_smoke.sh runs it in a
new venv, cargo and rustc off PATH): each path a user takes first, with exact
values. Run under gradpack.launch with argument 'worker', it is a worker of
the parameter-server job."""
import os
import shutil
import subprocess
import sys

import numpy as np


def check(what, got, expected):
    assert got == expected, "%s: got %r, expected %r" % (what, got, expected)
    print("ok  %-48s %s" % (what, got))


def worker():
    import gradpack.kv
    kv = gradpack.kv.create("dist_sync")
    kv.set_compress({"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
    kv.init(3, np.ones(4, np.float32))
    seen = []
    for g in (0.3, 0.3):  # 0.3 -> nothing, then 0.6 -> 0.5 on each of 2 workers
        kv.push(3, np.full(4, g, np.float32))
        out = np.zeros(4, np.float32)
        kv.pull(3, out=out)
        seen.append(out.tolist())
    check("worker %d pulled (dist_sync, 2bit)" % kv.rank, seen, [[0.0] * 4, [1.0] * 4])


def allreduce_rank():
    import gradpack.kv
    kv = gradpack.kv.create("dist_sync_allreduce")
    kv.set_compress({"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
    kv.init(3, np.ones(4, np.float32))
    kv.push(3, np.full(4, 0.6, np.float32))
    out = np.zeros(4, np.float32)
    kv.pull(3, out=out)
    check("MPI rank %d of %d pulled (2bit)" % (kv.rank, kv.num_workers), out.tolist(), [1.0] * 4)
    kv.close()


def main():
    for tool in ("cargo", "rustc"):
        check("%s on PATH" % tool, shutil.which(tool), None)
    import gradpack
    from gradpack import base
    here = os.path.dirname(os.path.abspath(gradpack.__file__))
    check("library from the installed wheel", base.lib_path, os.path.join(here, "_native.so"))
    print("    gradpack %s, codec kernel %s, scheme kernel %s" % (base.version(), base.kernel_name(),
                                                                  base.scheme_kernel_name()))

    from gradpack.nd import contrib
    grad = np.array([0, 2.5, 1, -3, 2, 0.5, -1, -2], np.float32)
    residual = np.zeros_like(grad)
    compr = contrib.create_2bit(grad)
    contrib.quantize_2bit(grad, residual, compr, -2.0, 2.0)
    check("numpy quantize_2bit block", hex(int(compr[3:].view(np.uint32)[0])), "0x12420000")
    check("numpy residual", residual.tolist(), [0, 0.5, 1, -1, 0, 0.5, -1, 0])
    out = np.empty_like(grad)
    contrib.dequantize_2bit(compr, out)
    check("numpy dequantize_2bit", out.tolist(), [0, 2, 0, -2, 2, 0, 0, -2])

    import mxnet as mx
    import gradpack.mxnet
    mg, mr = mx.nd.array(grad), mx.nd.zeros(8)
    mc = mx.nd.contrib.create_2bit(mg)
    mx.nd.contrib.quantize_2bit(mg, mr, mc, -2.0, 2.0)
    check("MXNet quantize_2bit block", hex(int(mc.asnumpy()[3:].view(np.uint32)[0])), "0x12420000")
    try:
        mx.nd.contrib.quantize_2bit(mg, mr, mx.nd.zeros(2), -2.0, 2.0)
        raise AssertionError("a wrong compr size passed")
    except gradpack.mxnet.OperatorError as e:
        check("MXNet operator error", str(e).split("\n")[0][:64], "quantize_2bit: compr has 2 elements, expected 4 (3 + ceil(n/16))")

    import gradpack.kv
    kv = gradpack.kv.create("device")
    kv.set_compress({"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
    kv.init(3, np.ones(4, np.float32))
    kv.push(3, [np.full(4, 0.6, np.float32), np.full(4, -0.2, np.float32)])
    w = np.zeros(4, np.float32)
    kv.pull(3, out=w)
    check("device store, 2 devices, 2bit", w.tolist(), [0.5] * 4)  # 0.5 + 0

    if os.environ.get("GRADPACK_SMOKE_NO_MPI") == "1":  # a machine without Open MPI (said, not guessed)
        check("no Open MPI on this machine", shutil.which("mpirun"), None)
        try:
            gradpack.kv.create("dist_sync_allreduce")
            raise AssertionError("the MPI store opened without an MPI")
        except gradpack.Error as e:
            check("MPI store without Open MPI: the error", "found no Open MPI" in str(e), True)
            print("    " + str(e))
    else:
        mpi = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
                              os.path.abspath(__file__), "allreduce"], timeout=180)
        check("mpirun -n 2 (the machine's Open MPI) exit status", mpi.returncode, 0)

    # The start-up hook: 'yes' serves the role (no job here: it fails, exit 1, and the script never runs);
    # a value that is no boolean is a warning and the program runs.
    hook = subprocess.run([sys.executable, "-c", "print('the script ran')"], capture_output=True, text=True,
                          env=dict(os.environ, GRADPACK_SERVE_ROLES="yes", DMLC_ROLE="server "), timeout=60)
    check("start-up hook serves with GRADPACK_SERVE_ROLES=yes", (hook.returncode, hook.stdout), (1, ""))
    hook = subprocess.run([sys.executable, "-c", "print('the script ran')"], capture_output=True, text=True,
                          env=dict(os.environ, GRADPACK_SERVE_ROLES="maybe", DMLC_ROLE="server"), timeout=60)
    check("start-up hook warns on GRADPACK_SERVE_ROLES=maybe", (hook.returncode, hook.stdout, "'maybe'" in hook.stderr),
          (0, "the script ran\n", True))

    job = subprocess.run([sys.executable, "-m", "gradpack.launch", "-n", "2", "-s", "1", "--timeout", "120",
                          sys.executable, os.path.abspath(__file__), "worker"], timeout=180)
    check("gradpack.launch -n 2 -s 1 exit status", job.returncode, 0)
    print("wheel smoke test: every check passed")


if __name__ == "__main__":
    {"worker": worker, "allreduce": allreduce_rank}.get(sys.argv[1] if sys.argv[1:] else "", main)()
