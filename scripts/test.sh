#!/usr/bin/env bash
# ember's test suite (CPU: the C++ backend, and Triton code through Triton's interpreter).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" numpy sympy pytest triton matplotlib rich expecttest
exec "$PY" -m pytest -q tests "$@"
