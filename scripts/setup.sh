#!/usr/bin/env bash
# Set up ember on a fresh machine; sourced by demo.sh and test.sh.
# Keeps an importable torch (e.g. the GPU machine's own CUDA build); otherwise installs torch==2.13.0.
# Installs only what is missing, so a machine without network that already has the packages works.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "${BASH_SOURCE[0]}")/.."

have() { "$PY" -c "import $1" >/dev/null 2>&1; }
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

have torch || pip_install torch==2.13.0
missing=()
for mod in "$@"; do
    have "$mod" || missing+=("$mod")
done
[ ${#missing[@]} -eq 0 ] || pip_install "${missing[@]}"

# Register the torch.compile backend entry point. --no-build-isolation and --no-deps keep it
# offline; if even that fails (no setuptools), fall back to importing from the checkout.
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'ember' for e in m.entry_points(group='torch_dynamo_backends')) else 1)" 2>/dev/null; then
    pip_install --no-build-isolation --no-deps -e . 2>/dev/null || echo "note: could not pip-install ember; using PYTHONPATH" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
