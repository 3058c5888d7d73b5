"""Writes tests/vectors/2bit.json from the numpy model (python/tests/numpy_2bit.py),
an implementation independent of the Rust kernels. Each case records several
quantize steps so residual state is covered, not only one call.

Run: python tests/vectors/generate.py   (needs numpy and ml_dtypes)"""
import json
import os
import sys

import ml_dtypes
import numpy as np

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "python", "tests"))
import numpy_2bit  # noqa: E402

DTYPES = {"float32": (np.float32, np.uint32), "float16": (np.float16, np.uint16),
          "bfloat16": (ml_dtypes.bfloat16, np.uint16)}


def case(rng, dtype, n, neg, pos, steps):
    ftype, itype = DTYPES[dtype]
    residual = np.zeros(n, np.float32)
    out = {"dtype": dtype, "n": n, "neg_threshold": neg, "pos_threshold": pos, "steps": []}
    for _ in range(steps):
        grad = rng.uniform(-1.5 * pos, -1.5 * neg, n).astype(np.float32).astype(ftype)
        compr, residual = numpy_2bit.quantize(grad, residual, neg, pos)
        out["steps"].append({
            "grad_bits": grad.view(itype).tolist(),
            "compr_bits": compr.view(np.uint32).tolist(),
            "residual_bits": residual.view(np.uint32).tolist(),
        })
    return out


def main():
    rng = np.random.default_rng(2024)
    cases = []
    for dtype in DTYPES:
        for n in (0, 1, 15, 16, 17, 33, 100):
            cases.append(case(rng, dtype, n, -0.5, 0.5, 4))
    cases.append(case(rng, "float32", 50, -0.25, 1.0, 5))  # asymmetric
    cases.append(case(rng, "float32", 40, -2.0, 2.0, 3))
    with open(os.path.join(here, "2bit.json"), "w") as f:
        json.dump({"spec": "docs/contract.md section 1", "generator": "tests/vectors/generate.py",
                   "cases": cases}, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
