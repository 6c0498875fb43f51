#!/usr/bin/env bash
# One device call sized for a 15-minute lease (the machine's start takes one to two of them): what a short lease
# can finish, then a measurement that sizes the next ones.
#  1. With BENCHMARKS=1, on the idle GPU (speed ratios need it to themselves): the FedTTA round of
#     benchmarks/vmap_engine.py and benchmarks/odpfl_round.py (both measured on an H200 with this script).
#  2. Until BUDGET_S seconds after the start: the first step of each row named in ROWS (lab/research/device_rows.tsv),
#     side by side, each cut off at the deadline. Their metrics.jsonl (round, cumulative wall_s) tell how many
#     GPU-minutes a whole row needs; a row that finishes leaves its raw result file.
# Sizing on an H200 (four rows side by side for 300 s, then two resumed for 365 s on the warm machine):
# FedTTA Fashion-MNIST reached round 67 of 300, FedTTA++ 53 of 300 (it validates with adaptation), btgfl-paper 55 of
# 130 (then finished: 586 s of training), fedicon-shift fashion_mnist-paper 43 of 100 (then FedICON and w/o TTA
# finished, 470 s of training; the online row did not). A FedTTA-family Fashion-MNIST row needs 23-29 GPU-minutes
# shared four ways: more than one 15-minute lease, so those rows need checkpoints carried across leases.
# Everything lands in $OUT: log.txt, rows.tgz (logs, metrics, results), with BENCHMARKS=1 vmap-engine.json and
# odpfl-round.json.
#
#   bash lab/research/device_session.sh      # carry .gpu_data: a copy of ../shared/data's mnist/ and fashion-mnist/
# Merge here (DIR: the call's files_at): python lab/research/merge_device_results.py DIR/rows.tgz for finished rows;
# the benchmark rows with lab.rows.merge_rows into docs/benchmarks/ (key: what, device).
set -uo pipefail
O=${OUT:-$PWD/runs/device-out}
mkdir -p "$O"
start=$(date +%s)
deadline=$(( start + ${BUDGET_S:-450} ))
export PYTHONPATH="$PWD:$PWD/edge_sdk" FL_DATA_DIR="${FL_DATA_DIR:-$PWD/.gpu_data}" PYTHONUNBUFFERED=1
LOG="$O/log.txt"
# default: rows that one lease can finish (btgfl-paper about 10 GPU-minutes, a fedicon-shift paper row about 8)
ROWS=${ROWS:-"btgfl-paper-s1 fic-fashion_mnist-paper-fedicon-s1 btgfl-paper-s2"}
say() { echo "== $(( $(date +%s) - start )) s: $*" | tee -a "$LOG"; }
source "$(dirname "$0")/rows_lib.sh"

say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
python3 -c "import torch, onnxruntime; print('torch', torch.__version__, torch.cuda.get_device_name())" >> "$LOG" 2>&1

if [ -n "${BENCHMARKS:-}" ]; then
say "vmap_engine FedTTA round"
timeout 240 python3 benchmarks/vmap_engine.py --device cuda --repeats 5 --cases 1 --out "$O/vmap-engine.json" \
    >> "$LOG" 2>&1 || say "vmap_engine exit $?"
say "odpfl_round"
timeout 120 python3 benchmarks/odpfl_round.py --device cuda --out "$O/odpfl-round.json" >> "$LOG" 2>&1 \
    || say "odpfl_round exit $?"
fi

Q=${QUEUE_DIR:-$PWD/runs/device-rows}
mkdir -p "$Q"/{logs,results,runs}
for name in $ROWS; do
    line=$(grep -P "^$name\t" lab/research/device_rows.tsv) || { say "no row $name"; continue; }
    step=${line#*$'\t'}
    step=${step%%&&*}  # the row's first step only
    eval "set -- $step"  # shell quoting inside a row, e.g. --methods 'HeteroFedTTA (no KD)'
    left=$(( deadline - $(date +%s) ))
    [ "$left" -gt 30 ] || { say "no time left for $name"; continue; }
    say "row $name: $step (cut off after $left s)"
    step_runner "$1"
    timeout "$left" "${STEP[@]}" "$@" --device cuda --no-progress --results-dir "$Q/results" \
        --runs-dir "$Q/runs" > "$Q/logs/$name.log" 2>&1 &
done
watch_rows 15
pack_rows
say "done"
