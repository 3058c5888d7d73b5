#!/usr/bin/env bash
# The main demo: quantize a gradient with 2-bit compression and error feedback.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$PYTHON" examples/demo_2bit.py "$@"
