#!/usr/bin/env bash
# Every test: Rust unit and integration tests, the C++ KVStore test program and
# example, then the Python tests against the installed package, real MXNet
# 1.9.1 included (a missing MXNet fails, not skips).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cargo test --release
cargo build --release  # libgradpack.a for the C++ programs
cxx=(g++ -std=c++17 -Wall -Werror -Iinclude -Itarget/cxxbridge)
"${cxx[@]}" tests/cpp/kvstore_test.cc target/release/libgradpack.a -lpthread -ldl -o target/cpp_kvstore_test
"${cxx[@]}" examples/cpp/kvstore_example.cc target/release/libgradpack.a -lpthread -ldl -o target/kvstore_example
target/cpp_kvstore_test
target/kvstore_example > /dev/null
GRADPACK_REQUIRE_MXNET=1 "$PYTHON" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning python/tests
