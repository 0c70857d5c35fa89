#!/usr/bin/env bash
# The OpInfo sweep on the GPU machine, sharded over its CPUs (one GPU, shared by the shards).
#   bash scripts/gpu_opinfo.sh OUT [SHARDS] [TIME_LIMIT_S] [extra opinfo flags, e.g. --resume]
# Each shard writes OUT/sK/cuda.jsonl after every (op, dtype) pair, so a run cut off by the time
# limit keeps what it finished; copy the shards back into OUT and pass --resume to go on.
# Merge on any machine: ember opinfo --device cuda --merge OUT/s*/cuda.jsonl --out docs/opinfo
# The image lacks expecttest (torch.testing._internal imports it): put its wheel in .whl/.
set -u
out=$1; shards=${2:-15}; limit=${3:-540}; shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out/smoke"; for k in $(seq 1 "$shards"); do mkdir -p "$out/s$k"; done
if ! python3 -c "import expecttest" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ember_site .whl/*.whl
    export PYTHONPATH=/tmp/ember_site:${PYTHONPATH:-}
fi
# A smoke pair first: a broken setup fails in seconds, not after the whole time limit.
python3 -m ember.tools.opinfo --device cuda --ops abs,sum --dtypes float32 --limit 2 --out "$out/smoke" >"$out/smoke.log" 2>&1
if ! grep -q " 0 crash" "$out/smoke.log" || grep -q " 0 match" "$out/smoke.log"; then
    tail -30 "$out/smoke.log"; exit 1
fi
for k in $(seq 1 "$shards"); do
    timeout "$limit" python3 -m ember.tools.opinfo --device cuda --shard "$k/$shards" --timeout-s 120 \
        --out "$out/s$k" "$@" >"$out/log$k" 2>&1 &
done
wait
for k in $(seq 1 "$shards"); do echo "shard $k: $(wc -l <"$out/s$k/cuda.jsonl" 2>/dev/null || echo 0) pairs; $(tail -1 "$out/log$k")"; done
