#!/usr/bin/env bash
# Run `fl-server bench` commands in priority order on a lent GPU machine within one call's time budget, then
# pack the raw result files for the session to merge (one result file per dataset/method/seed: whatever finished
# is kept; a seed cut off by the budget starts again on a later call, since run directories stay on the machine
# only while it is warm). Size each call's list to the budget: the device gives 10 minutes a call.
#
#   bash scripts/device_queue.sh BUDGET_S "bench ARGS" ["bench ARGS" ...]
#
# e.g. (from the device tool, carrying .gpu_data = a copy of ../shared/data's mnist and fashion-mnist folders):
#   bash scripts/device_queue.sh 540 \
#     "bench upfl-table1 --dataset fashion_mnist --seeds 3 --methods FedAvg TENT" \
#     "bench upfl-table1 --dataset fashion_mnist --seeds 1 --methods FedTTA++"
# Results: $OUT/results.tgz (docs/results/raw, docs/benchmarks) and $OUT/queue.log. Merge here with
#   tar xzf results.tgz && fl-server report   (the tables are re-aggregated from the raw files by the next bench
#   run of the same experiment, or with fl_server.bench.runner.aggregate).
set -uo pipefail
budget=${1:?budget in seconds}; shift
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/edge_sdk${PYTHONPATH:+:$PYTHONPATH}" FL_DATA_DIR="${FL_DATA_DIR:-$PWD/.gpu_data}"
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s)
for cmd in "$@"; do
    left=$(( budget - ($(date +%s) - start) ))
    if [ "$left" -lt 30 ]; then echo "budget spent; not started: $cmd"; continue; fi
    echo "== $cmd  (${left}s left)"
    # SIGINT first: checkpoints are atomic, so a seed cut off here resumes if the machine is still warm
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=20 "$left" python -m fl_server.cli $cmd --no-progress \
        || echo "stopped or failed ($?): $cmd"
done 2>&1 | tee "$OUT/queue.log"
tar czf "$OUT/results.tgz" docs/results/raw docs/benchmarks 2>/dev/null
echo "packed $(du -h "$OUT/results.tgz" | cut -f1) in $OUT/results.tgz"
