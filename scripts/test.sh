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
# Two worker processes (pytest-xdist), each taking whole files, so a module's fixtures are built once: most
# tests spend their time tracing in one Python thread. Where pytest-xdist cannot be installed, one process.
have xdist || pip_install pytest-xdist || echo "note: no pytest-xdist: the tests run in one process" >&2
workers=()
have xdist && workers=(-n "${EMBER_TEST_WORKERS:-2}" --dist loadfile)
exec "$PY" -m pytest -q ${workers[@]+"${workers[@]}"} tests "$@"
