"""gradpack demo: 2-bit quantization with error feedback on a gradient.

Shows the packed floats (header, then 16 two-bit codes per float), the
residual that carries what was not sent, the compression ratio and the speed."""
import sys
import time

import numpy as np

import gradpack
from gradpack.nd import contrib


def main(n=16 * 1024 * 1024):
    print("gradpack %s, codec kernel: %s" % (gradpack.__version__, gradpack.kernel_name()))
    # The example of docs/contract.md section 1.
    grad = np.array([0, 2.5, 1, -3, 2, 0.5, -1, -2], np.float32)
    residual = np.zeros_like(grad)
    compr = contrib.create_2bit(grad)
    contrib.quantize_2bit(grad, residual, compr, -2.0, 2.0)
    print("\ngrad     =", grad)
    print("compr    =", compr, " block bits: 0x%08x" % compr[3:].view(np.uint32)[0])
    print("residual =", residual)
    decoded = np.empty_like(grad)
    contrib.dequantize_2bit(compr, decoded)
    print("decoded  =", decoded)

    # A large gradient, several steps: error feedback keeps the running sum honest.
    rng = np.random.default_rng(0)
    grad = rng.normal(0, 0.3, n).astype(np.float32)
    residual = np.zeros(n, np.float32)
    compr = contrib.create_2bit(grad)
    sent = np.zeros(n, np.float32)
    decoded = np.empty(n, np.float32)
    steps = 5
    # One untimed step first: it faults in the fresh pages and starts the threads.
    contrib.quantize_2bit(np.zeros(n, np.float32), np.zeros(n, np.float32), compr, -0.5, 0.5)
    contrib.dequantize_2bit(compr, decoded)
    t_q = t_d = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        contrib.quantize_2bit(grad, residual, compr, -0.5, 0.5)
        t1 = time.perf_counter()
        contrib.dequantize_2bit(compr, decoded)
        t2 = time.perf_counter()
        t_q += t1 - t0
        t_d += t2 - t1
        sent += decoded
    total = grad * steps
    print("\n%d elements x %d steps, thresholds +-0.5" % (n, steps))
    print("bytes: %d float32 -> %d packed (%.1fx smaller)"
          % (grad.nbytes, compr.nbytes, grad.nbytes / compr.nbytes))
    print("max |sum(grad) - sum(decoded) - residual| = %.3g  (error feedback: nothing lost)"
          % np.abs(total - sent - residual).max())
    print("quantize:   %.2f Gelem/s (%.1f ms per step)" % (n * steps / t_q / 1e9, t_q / steps * 1e3))
    print("dequantize: %.2f Gelem/s (%.1f ms per step)" % (n * steps / t_d / 1e9, t_d / steps * 1e3))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
