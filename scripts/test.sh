#!/usr/bin/env bash
# Every test: Rust unit and integration tests, the C++ KVStore test program and
# example, then the Python tests against the installed package, real MXNet
# 1.9.1 included (a missing MXNet fails, not skips).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# The set-up's Debian dependencies, checked against dpkg and the files the build uses.
bash scripts/env.sh --check
# The crate's modules: no cycle among siblings at any level, no private reach, no use of a layer above
# its own (docs/architecture.md's table of layers); the check checks itself first.
"$PYTHON" scripts/module_cycles.py --self-test
"$PYTHON" scripts/module_cycles.py
# Feature mpi: the all-reduce store (its tests run themselves under mpirun).
# Feature cuda: the CUDA kernels compile with NVRTC for sm_70 and sm_90, and
# say "CUDA not available" without a driver (their GPU tests are #[ignore]d
# here and run with --ignored on a GPU machine: docs/cuda.md).
cargo test --release --features mpi,cuda
# Without the cuda feature: the stand-in's error.
cargo test --release --lib cuda::
# The unit tests once more in the debug profile, where overflow checks and
# debug_assert!s are live.
cargo test --lib --features mpi,cuda
# The crate as published: docs.rs-style docs (no MPI, MXNet or GPU) without a
# warning, and `cargo package`, which builds the packaged crate on its own.
RUSTDOCFLAGS="-D warnings" cargo doc --no-default-features --no-deps
cargo package --allow-dirty
cargo build --release --features mpi  # libgradpack.a for the C++ programs
cxx=(g++ -std=c++17 -Wall -Werror -Iinclude -Itarget/cxxbridge)
libs=(target/release/libgradpack.a -lpthread -ldl)  # MPI is loaded at run time
"${cxx[@]}" tests/cpp/kvstore_test.cc "${libs[@]}" -o target/cpp_kvstore_test
"${cxx[@]}" examples/cpp/kvstore_example.cc "${libs[@]}" -o target/kvstore_example
target/cpp_kvstore_test
target/kvstore_example > /dev/null
GRADPACK_REQUIRE_MXNET=1 "$PYTHON" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning python/tests
# The wheel users install (manylinux_2_28, no MPI inside), built once, then
# installed into a new venv with cargo and rustc off PATH and smoke-tested.
bash scripts/wheel.sh
bash scripts/wheel_smoke.sh
