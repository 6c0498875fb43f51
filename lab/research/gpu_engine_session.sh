#!/usr/bin/env bash
# One device call sized for a 15-minute lease: the engine's GPU paths checked, optionally timed, then rows of
# lab/research/device_rows.tsv one at a time (the Fashion-MNIST UPFL Table-1 rows of the FedTTA family, each followed
# by its upfl-data-size step; the hetero rows; the gap study's probes), all cut off at the deadline.
#  1. tests/test_gpu_engine.py (graphed, GEMM and stacked rounds equal eager rounds in float64 on the GPU; NO_TESTS=1
#     skips it, and then mnist/ need not be carried);
#  2. with BENCH=1 only: benchmarks/gpu_engine.py --device cuda $BENCH_ARGS (default: FedTTA at torch's default
#     precision, as rows run, eager against graphed, gemm_graphed (the gather form; the im2col form measured
#     0.27x, docs/research/gpu-engine.md), bf16_graphed, graphed_stacked and gemm_graphed_stacked (two seeds'
#     rounds as one, as the s12 rows run them, on either path)): per variant s/round, first-round memory peak,
#     parity over two float64 rounds (a capture and a replay), kernels per round, written in that order as each
#     is measured, so that the timeout keeps what was measured;
#  3. FL_BATCHED_CONV (the engine's convolution path for the rows): as given, else "gemm" where step 2 timed
#     gemm_graphed faster than graphed, else native; never bf16 (other arithmetic:
#     its rows must first match the float32 rows on validation);
#  4. rows until BUDGET_S seconds after the start, LANES at a time (default 1: a row alone has the GPU). A row's
#     steps are `python -m lab` commands (bench ...) or research scripts (lab/research/*.py: the gap-* rows,
#     probe_family_training.py, validation only), each given --device, --no-progress, --results-dir and
#     --runs-dir. A row cut off leaves its checkpoint: ckpt-<run>.tgz holds what resuming needs of its run folder
#     (lab/research/lease_checkpoints.py: 6 MB when the best round is the checkpoint's, else 12 MB; split into
#     ckpt-<run>.tgz.partNN where it exceeds what a lease returns per file). `lease_checkpoints.py keep` joins them
#     into lab/research/lease-checkpoints/ (tracked: commit it with the results, as the machine is gone after the
#     lease); the next call carries them with the tree and the rows resume from them (graphs and the GEMM path are
#     not part of a run's identity, bf16 convolutions are). Finished rows send their best states back
#     (best-states.tgz[.partNN]) for the CPU probes.
# ROWS_FILE, DEVICE and EXTRA_ARGS (more `python -m lab bench` flags) serve the CPU dry run at smoke size
# (lab/tests/test_gpu_session_dry_run.py).
# Everything lands in $OUT: log.txt, gpu-engine.json, rows.tgz (logs, results, metrics), ckpt-*.tgz[.partNN],
# best-states.tgz[.partNN]. On an H200, alone: about 1.0 s a round for FedTTA, 1.3 s for FedTTA++ (it validates
# with up to 50 adaptation steps), 16-20 s for a row's upfl-data-size step.
#
#   bash lab/research/lease_carry.sh prepare --tests   # here, first: .gpu_data, docs/results aside (64 MiB carried)
#   bash lab/research/gpu_engine_session.sh              # the call, carry [".gpu_data"]
#   bash lab/research/lease_carry.sh restore             # here, after
# Merge here (DIR: the call's files_at): python lab/research/merge_device_results.py DIR/rows.tgz for finished
# rows and the checkpoints (lease_checkpoints.py keep DIR); the benchmark rows with lab.rows.merge_rows into
# docs/benchmarks/gpu-engine.json. Commit all of it at once.
set -uo pipefail
O=${OUT:-$PWD/runs/device-out}
mkdir -p "$O"
start=$(date +%s)
deadline=$(( start + ${BUDGET_S:-555} ))
export PYTHONPATH="$PWD:$PWD/edge_sdk" FL_DATA_DIR="${FL_DATA_DIR:-$PWD/.gpu_data}" PYTHONUNBUFFERED=1
LOG="$O/log.txt"
say() { echo "== $(( $(date +%s) - start )) s: $*" | tee -a "$LOG"; }
source "$(dirname "$0")/rows_lib.sh"
[ -e ../shared/data ] || { mkdir -p ../shared && ln -sfn "$FL_DATA_DIR" ../shared/data; }  # the tests' data folder

say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
python3 -c "import torch, onnxruntime; print('torch', torch.__version__, torch.cuda.get_device_name())" >> "$LOG" 2>&1

if [ -z "${NO_TESTS:-}" ]; then
say "tests/test_gpu_engine.py"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py >> "$LOG" 2>&1 || say "pytest exit $?"
fi
if [ -n "${BENCH:-}" ]; then
say "benchmarks/gpu_engine.py"
timeout 300 python3 benchmarks/gpu_engine.py --device cuda \
    ${BENCH_ARGS:---repeats 2 --stack 2 --tf32 --methods FedTTA --variants graphed gemm_graphed bf16_graphed graphed_stacked gemm_graphed_stacked} \
    --out "$O/gpu-engine.json" >> "$LOG" 2>&1 || say "gpu_engine exit $?"
fi
if [ -z "${FL_BATCHED_CONV:-}" ]; then  # the faster path of the benchmark's first row, native without one
    FL_BATCHED_CONV=$(python3 -c 'import json, sys
rows = json.load(open(sys.argv[1])) if __import__("os").path.exists(sys.argv[1]) else []
row = next((r for r in rows if r.get("gemm_graphed_s") and r.get("graphed_s")), None)
print("gemm" if row and row["gemm_graphed_s"] < row["graphed_s"] else "native")' "$O/gpu-engine.json")
fi
export FL_BATCHED_CONV
say "rows take batched_conv=$FL_BATCHED_CONV"

Q=${QUEUE_DIR:-$PWD/runs/device-rows}
mkdir -p "$Q"/{logs,results,runs}
for a in "${CKPT_DIR:-$PWD/lab/research/lease-checkpoints}"/ckpt-*.tgz; do [ -e "$a" ] && tar xzf "$a" -C "$Q/runs" && say "resumes $a"; done
python3 lab/research/lease_checkpoints.py restore "$Q/runs" >> "$LOG" 2>&1 || say "restore exit $?"
run_row() {  # one row of device_rows.tsv (both its steps), cut off at the deadline
    local name=$1 line cmd left
    line=$(grep -P "^$name\t" "${ROWS_FILE:-lab/research/device_rows.tsv}") || { say "no row $name"; return 1; }
    cmd=${line#*$'\t'}
    local steps=("${cmd%%&&*}")  # one step, or two joined by &&
    [[ "$cmd" != *"&&"* ]] || steps+=("${cmd#*&&}")
    for step in "${steps[@]}"; do
        eval "set -- $step"
        left=$(( deadline - $(date +%s) ))
        [ "$left" -gt 20 ] || { say "no time left for $name"; return 1; }
        say "row $name: $step (cut off after $left s)"
        local STEP; step_runner "$1"
        timeout "$left" "${STEP[@]}" "$@" --device "${DEVICE:-cuda}" ${EXTRA_ARGS:-} --no-progress \
            --results-dir "$Q/results" --runs-dir "$Q/runs" >> "$Q/logs/$name.log" 2>&1 ||
            { say "row $name exit $?"; return 1; }
    done
    say "row $name done"
}
lane() { for name in "$@"; do run_row "$name" || return; done; }
# the rows in order, cut-off ones first; LANES lanes take every LANES-th row. A row of two seeds (-s12) trains them
# stacked (--stack-seeds): one round over both seeds' clients
ROWS=(${ROWS:-t1-fedtta-s1 t1-fedtta-prox-s12 t1-fedtta-s2 t1-fedttapp-s2})
LANES=${LANES:-1}
for (( k = 0; k < LANES; k++ )); do
    mine=(); for (( i = k; i < ${#ROWS[@]}; i += LANES )); do mine+=("${ROWS[i]}"); done
    lane "${mine[@]}" &
done
watch_rows 10
pack_rows
split_big() { [ ! -e "$1" ] || [ "$(stat -c %s "$1")" -le 15000000 ] || { split -b 15000000 -d "$1" "$1.part" && rm "$1"; }; }
# run folders whose row has no result yet: their checkpoints, to resume in a later lease
for d in $(find "$Q/runs" -name checkpoint.npz -printf '%h\n' | sort); do
    rel=${d#"$Q/runs/"}  # <experiment>/<dataset>/<method>/seedK, as the raw result's path
    if [ ! -e "$Q/results/raw/$rel.json" ] && [ ! -e "$d/probe-row.json" ]; then  # unfinished (a probe: no row yet)
        f="$O/ckpt-$(echo "$rel" | tr '/+ ' '_pp_').tgz"
        python3 lab/research/lease_checkpoints.py pack "$Q/runs" "$rel" "$f" >> "$LOG" 2>&1 ||
            { say "slim pack of $rel failed: the whole folder instead"; rm -f "$f"; (cd "$Q/runs" && tar czf "$f" "$rel"); }
        split_big "$f"
    fi
done
python3 lab/research/lease_checkpoints.py bests "$Q/runs" "$Q/results" "$O/best-states.tgz" >> "$LOG" 2>&1
split_big "$O/best-states.tgz"
ls -la "$O" >> "$LOG"
say "done"
