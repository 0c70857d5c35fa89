#!/usr/bin/env bash
# ember's test suite (CPU: the C++ backend, and Triton code through Triton's interpreter).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" numpy sympy pytest triton matplotlib rich expecttest transformers onnxruntime onnxscript
# The HTML report's test drives a real headless Chromium (tests/tools/test_explain_html.py). Where it
# cannot be installed the test fails, naming what is missing: it never skips.
if ! command -v chromium >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if command -v apt-get >/dev/null 2>&1; then
        { $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium >/dev/null; } ||
            echo "warning: apt-get could not install chromium: the HTML report's browser test will fail" >&2
    else
        echo "warning: no apt-get to install chromium: the HTML report's browser test will fail" >&2
    fi
fi
exec "$PY" -m pytest -q tests "$@"
