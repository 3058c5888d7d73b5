"""Import MXNet for a test module: under the test command (GRADPACK_REQUIRE_MXNET=1)
a missing MXNet fails the run instead of skipping it."""
import os

import pytest


def mxnet():
    if os.environ.get("GRADPACK_REQUIRE_MXNET") == "1":
        import mxnet as mx
        return mx
    return pytest.importorskip("mxnet")
