#!/usr/bin/env bash
# One device call sized for a 15-minute lease: the CUDA-graph engine checked and measured on the idle GPU, then the
# Fashion-MNIST UPFL Table-1 rows of the FedTTA family (scripts/research/device_rows.tsv) in three lanes side by
# side (one per method, seeds in turn), each row followed by its upfl-data-size step, all cut off at the deadline.
#  1. tests/test_gpu_engine.py (graphed rounds equal eager rounds in float64 on the GPU);
#  2. benchmarks/gpu_engine.py --device cuda: eager against graphed rounds, kernels per round, float64 parity;
#  3. rows until BUDGET_S seconds after the start. A row cut off leaves its checkpoint: ckpt-<run>.tgz holds its run
#     folder (split into ckpt-<run>.tgz.partNN where it exceeds what a lease returns per file; `cat` them back).
#     Put the archives of an earlier lease into .gpu_ckpt/ (carried) and the rows resume from them.
# Everything lands in $OUT: log.txt, gpu-engine.json, rows.tgz (logs, results, metrics), ckpt-*.tgz[.partNN].
#
#   bash scripts/research/gpu_engine_session.sh   # carry .gpu_data (a copy of ../shared/data's mnist/ and
#                                                 # fashion-mnist/) and .gpu_ckpt; NO_BENCH=1 skips steps 1-2
# Merge here (DIR: the call's files_at): python scripts/research/merge_device_results.py DIR/rows.tgz for finished
# rows; the benchmark rows with fl_server.bench.rows.merge_rows into docs/benchmarks/gpu-engine.json.
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

if [ -z "${NO_BENCH:-}" ]; then
say "tests/test_gpu_engine.py"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py >> "$LOG" 2>&1 || say "pytest exit $?"
say "benchmarks/gpu_engine.py"
timeout 240 python3 benchmarks/gpu_engine.py --device cuda --repeats 3 --out "$O/gpu-engine.json" >> "$LOG" 2>&1 \
    || say "gpu_engine exit $?"
fi

Q=${QUEUE_DIR:-$PWD/runs/device-rows}
mkdir -p "$Q"/{logs,results,runs}
for a in "${CKPT_DIR:-$PWD/.gpu_ckpt}"/ckpt-*.tgz; do [ -e "$a" ] && tar xzf "$a" -C "$Q/runs" && say "resumes $a"; done
run_row() {  # one row of device_rows.tsv (both its steps), cut off at the deadline
    local name=$1 line cmd left
    line=$(grep -P "^$name\t" scripts/research/device_rows.tsv) || { say "no row $name"; return 1; }
    cmd=${line#*$'\t'}
    for step in "${cmd%%&&*}" "${cmd#*&&}"; do
        eval "set -- $step"
        left=$(( deadline - $(date +%s) ))
        [ "$left" -gt 20 ] || { say "no time left for $name"; return 1; }
        say "row $name: $step (cut off after $left s)"
        timeout "$left" python3 -m fl_server.cli "$@" --device "${DEVICE:-cuda}" ${EXTRA_ARGS:-} --no-progress --results-dir "$Q/results" \
            --runs-dir "$Q/runs" >> "$Q/logs/$name.log" 2>&1 || { say "row $name exit $?"; return 1; }
    done
    say "row $name done"
}
lane() { for name in "$@"; do run_row "$name" || return; done; }
ROWS_FEDTTA=${ROWS_FEDTTA:-"t1-fedtta-s0 t1-fedtta-s1 t1-fedtta-s2"}
ROWS_PROX=${ROWS_PROX:-"t1-fedtta-prox-s0 t1-fedtta-prox-s1 t1-fedtta-prox-s2"}
ROWS_PP=${ROWS_PP:-"t1-fedttapp-s0 t1-fedttapp-s1 t1-fedttapp-s2"}
lane $ROWS_FEDTTA & lane $ROWS_PROX & lane $ROWS_PP &
watch_rows 10
pack_rows
# run folders whose row has no result yet: their checkpoints, to resume in a later lease
for d in $(find "$Q/runs" -name checkpoint.npz -printf '%h\n' | sort); do
    rel=${d#"$Q/runs/"}  # <experiment>/<dataset>/<method>/seedK, as the raw result's path
    if [ ! -e "$Q/results/raw/$rel.json" ]; then
        f="$O/ckpt-$(echo "$rel" | tr '/+ ' '_pp_').tgz"
        (cd "$Q/runs" && tar czf "$f" "$rel")
        [ "$(stat -c %s "$f")" -le 15000000 ] || { split -b 15000000 -d "$f" "$f.part" && rm "$f"; }
    fi
done
ls -la "$O" >> "$LOG"
say "done"
