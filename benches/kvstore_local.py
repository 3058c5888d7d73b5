"""Local/device KVStore benchmark: push + pull of one large key from 2 devices,
gradpack with and without 2-bit compression, beside MXNet 1.9.1's own 'device'
store with and without its built-in 2-bit compression (contexts cpu(0) and
cpu(1)), all in this one run.

Run: .venv/bin/python benches/kvstore_local.py [elements] [iterations]"""
import sys
import time

import numpy as np

import gradpack


def timed(fn, iters):
    fn()  # warm-up: allocations, residuals, thread pools
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def gradpack_case(n, compress, iters):
    kv = gradpack.kv.create("device")
    if compress:
        kv.set_compress({"compress": "2bit", "pos_threshold": 0.5, "neg_threshold": -0.5})
    rng = np.random.default_rng(0)
    grads = [rng.uniform(-1, 1, n).astype(np.float32) for _ in range(2)]
    outs = [np.empty(n, np.float32) for _ in range(2)]
    kv.init(0, np.zeros(n, np.float32))

    def step():
        kv.push(0, grads)
        kv.pull(0, out=outs)
    return timed(step, iters), kv.stats()


def mxnet_case(n, compress, iters):
    import mxnet as mx
    kv = mx.kv.create("device")
    if compress:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    rng = np.random.default_rng(0)
    ctxs = [mx.cpu(0), mx.cpu(1)]
    grads = [mx.nd.array(rng.uniform(-1, 1, n).astype(np.float32), ctx=c) for c in ctxs]
    outs = [mx.nd.empty(n, ctx=c) for c in ctxs]
    kv.init(0, mx.nd.zeros(n))

    def step():
        kv.push(0, grads)
        kv.pull(0, out=outs)
        for o in outs:
            o.wait_to_read()
    return timed(step, iters)


def main(n=16 * 1024 * 1024, iters=5):
    n, iters = int(n), int(iters)
    print("push+pull of one %d-element float32 key from 2 devices, median of %d iterations"
          % (n, iters))
    print("gradpack kernel: %s\n" % gradpack.kernel_name())
    g_plain, _ = gradpack_case(n, False, iters)
    g_2bit, stats = gradpack_case(n, True, iters)
    try:
        m_plain = mxnet_case(n, False, iters)
        m_2bit = mxnet_case(n, True, iters)
    except ImportError:
        m_plain = m_2bit = None
    rows = [("gradpack device, no compression", g_plain), ("gradpack device, 2bit +-0.5", g_2bit)]
    if m_plain is not None:
        rows += [("MXNet 1.9.1 device, no compression", m_plain),
                 ("MXNet 1.9.1 device, 2bit threshold 0.5", m_2bit)]
    print("%-40s %10s" % ("store", "ms/iter"))
    for name, t in rows:
        print("%-40s %10.1f" % (name, t * 1e3))
    print()
    print("gradpack 2bit / gradpack uncompressed: %.2fx the time" % (g_2bit / g_plain))
    if m_plain is not None:
        print("MXNet 2bit / gradpack 2bit:            %.1fx (gradpack faster by this factor)" % (m_2bit / g_2bit))
        print("MXNet 2bit / MXNet uncompressed:       %.1fx the time" % (m_2bit / m_plain))
    print("bytes between devices per push (gradpack 2bit): %.2f MiB packed vs %.2f MiB float32 (%.1fx smaller)"
          % (stats["wire_bytes"] / (iters + 1) / 2**20, stats["raw_bytes"] / (iters + 1) / 2**20,
             stats["raw_bytes"] / stats["wire_bytes"]))


if __name__ == "__main__":
    main(*sys.argv[1:])
