#!/usr/bin/env bash
# The main demo: a digits MLP trained on 2 CPU contexts through a real MXNet
# 1.9.1 Gluon Trainer, with and without gradpack's 2-bit compression.
# (examples/demo_2bit.py shows the codec alone: packed floats, residual, speed.)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$PYTHON" examples/train_digits.py "$@"
