#!/usr/bin/env bash
# ember's demo: compile a model on the GPU if present (else the CPU), check it against eager,
# print the speed-up and the kernels ember made.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" numpy sympy
exec "$PY" -m ember.tools.demo "$@"
