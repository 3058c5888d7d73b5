"""Without MXNet, gradpack still works and gradpack.mxnet says what to install."""
import subprocess
import sys

BLOCK_MXNET = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == 'mxnet' or name.startswith('mxnet.'):
            raise ImportError('No module named ' + repr(name))
sys.meta_path.insert(0, Block())
"""


def run(code):
    return subprocess.run([sys.executable, "-c", BLOCK_MXNET + code], capture_output=True, text=True)


def test_gradpack_works_without_mxnet():
    out = run("import numpy as np, gradpack\n"
              "from gradpack.nd import contrib as c\n"
              "g = np.ones(3, np.float32); r = np.zeros(3, np.float32); k = c.create_2bit(g)\n"
              "c.quantize_2bit(g, r, k, -0.5, 0.5); print(k.view(np.uint32)[3] == 0x54000000)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_gradpack_mxnet_says_what_to_install():
    out = run("import gradpack.mxnet")
    assert out.returncode != 0
    assert "ImportError: gradpack.mxnet needs MXNet 1.9.1: pip install 'mxnet==1.9.1'" in out.stderr
