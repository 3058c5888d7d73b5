#!/usr/bin/env bash
# Every test: Rust unit and integration tests, then the Python tests against the
# installed package, real MXNet 1.9.1 included (a missing MXNet fails, not skips).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cargo test --release
GRADPACK_REQUIRE_MXNET=1 "$PYTHON" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning python/tests
