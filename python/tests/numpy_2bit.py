"""An independent numpy model of docs/contract.md §1 (vectorised, float32 throughout): the
oracle for the committed vectors and the Python tests, and the numpy baseline
of the codec benchmark."""
import numpy as np

_SHIFTS = (30 - 2 * np.arange(16, dtype=np.uint32)).astype(np.uint32)


def quantize(grad, residual, neg, pos):
    """Returns (compr, new_residual) for float32 residual and any float grad."""
    neg, pos = np.float32(neg), np.float32(pos)
    r = residual + grad.astype(np.float32)
    ge = r >= pos
    le = (r <= neg) & ~ge
    new_residual = np.where(ge, r - pos, np.where(le, r - neg, r)).astype(np.float32)
    n = grad.size
    codes = np.zeros(-(-n // 16) * 16, dtype=np.uint32)
    codes[:n] = ge.astype(np.uint32) | (le.astype(np.uint32) << 1)
    words = (codes.reshape(-1, 16) << _SHIFTS).sum(axis=1, dtype=np.uint32)
    header = np.array([neg, pos, np.float32(n)], dtype=np.float32)
    return np.concatenate([header, words.view(np.float32)]), new_residual


def dequantize(compr, n):
    neg, pos = compr[0], compr[1]
    words = compr[3:].view(np.uint32)
    codes = ((words[:, None] >> _SHIFTS) & 3).reshape(-1)[:n]
    return np.where(codes == 1, pos, np.where(codes == 2, neg, np.float32(0))).astype(np.float32)
