#!/usr/bin/env bash
# Run many `python -m lab bench` rows side by side on a lent GPU machine, detached from the device tool's calls, and
# pack whatever finished. One result file per (experiment, dataset, method, seed), so a row cut off by the end
# of the lease is simply missing and runs again later; a failed row keeps its log and is retried by `start`.
#
#   bash lab/research/device_queue.sh start JOBS    # copy the tree to $QUEUE_DIR, start MPS, start the queue, return
#   bash lab/research/device_queue.sh status        # progress of every row; packs $OUT/results.tgz (raw results, logs)
#
# JOBS holds one row per line, "NAME<TAB>bench ARGS [&& bench ARGS ...]" (or a research script's step,
# lab/research/SCRIPT.py ARGS: rows_lib.sh step_runner), in priority order, e.g.
#   t1-fedttapp-s0	bench upfl-table1 --dataset fashion_mnist --methods FedTTA++ --seed 0 && bench upfl-data-size ...
# (steps of one row run in turn: upfl-data-size then reuses the upfl-table1 run it shares instead of racing it).
# Every row gets --device cuda (DEVICE=cpu for a smoke test of this script) --no-progress and the queue's own --results-dir / --runs-dir appended.
# A row starts only while fewer than MAX_JOBS rows run and the GPU has MIN_FREE_MB free: GPU memory, not
# compute, is what runs out first (a FedTTA ConvNet row on Fashion-MNIST holds about 8.5 GB; a 20-wide start
# without the gate ran the H100 out of memory within a minute). Between device calls the machine stays warm
# only for a few seconds, so keep calling `status` (with a sleep) while rows run.
# lab/research/device_rows.tsv lists the GPU rows still missing from docs/results (keep it current as rows land).
# Speed-ratio benchmarks need the GPU to themselves: run them before the queue (lab/research/device_session.sh does,
# and is the script for a short lease: benchmarks first, then rows side by side until a deadline).
# Data: carry a copy of ../shared/data (mnist/, fashion-mnist/) as .gpu_data, or set FL_DATA_DIR.
# Merge here: python lab/research/merge_device_results.py results.tgz (adds the new raw files to docs/results,
# re-aggregates the touched tables and rewrites docs/RESULTS.md).
set -uo pipefail
source "$(dirname "$0")/rows_lib.sh"
Q=${QUEUE_DIR:-$HOME/fl-edge-queue}
MAX_JOBS=${MAX_JOBS:-16}
MIN_FREE_MB=${MIN_FREE_MB:-14000}

gpu_free_mb() {  # free GPU memory; a large number without nvidia-smi (CPU smoke tests of this script)
    nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | head -1 || echo 1000000
}

run_row() {  # one row ("bench A && bench B": in turn, stopping at a failure): its log, then done/NAME
    local name=${1%%$'\t'*} rest=${1#*$'\t'} step start rc=0
    start=$(date +%s)
    echo "start $(date -u +%T)" > "$Q/logs/$name.log"
    while [ -n "$rest" ] && [ "$rc" = 0 ]; do
        step=${rest%%&&*}
        if [ "$step" = "$rest" ]; then rest=""; else rest=${rest#*&&}; fi
        eval "set -- $step"  # shell quoting inside a row, e.g. --methods 'HeteroFedTTA (no KD)'
        step_runner "$1"
        (cd "$Q/repo" && "${STEP[@]}" "$@" --device "${DEVICE:-cuda}" --no-progress \
            --results-dir "$Q/results" --runs-dir "$Q/runs") >> "$Q/logs/$name.log" 2>&1
        rc=$?
    done
    echo "$rc $(( $(date +%s) - start ))" > "$Q/done/$name"  # "<exit code> <seconds>"
}

queue() {  # launch rows in order, gated by running count and free GPU memory
    local line name running
    while IFS= read -r line || [ -n "$line" ]; do
        [ -z "$line" ] && continue
        name=${line%%$'\t'*}
        [ -e "$Q/done/$name" ] && [ "$(cut -d' ' -f1 "$Q/done/$name")" = 0 ] && continue
        rm -f "$Q/done/$name"
        while :; do
            running=$(pgrep -c -f "^python3 (-m lab bench|lab/research/)" || true)
            [ "$running" -lt "$MAX_JOBS" ] && [ "$(gpu_free_mb)" -gt "$MIN_FREE_MB" ] && break
            sleep 10
        done
        echo "$(date -u +%T) start $name (running $running)"
        run_row "$line" &
        sleep 20  # let the row allocate before the next memory reading
    done < "$Q/jobs.txt"
    wait
}

case ${1:-} in
start)
    jobs=${2:?JOBS file}
    if pgrep -f "device_queue.sh _queue" > /dev/null; then echo "a queue is running; start again once it ends"; exit 1; fi
    mkdir -p "$Q"/{logs,done,results,runs}
    rm -rf "$Q/repo" && mkdir -p "$Q/repo" && tr -d '\r' < "$jobs" > "$Q/jobs.txt"
    # the rows run from a copy, so the tree can change under a running queue (no venv, runs or git history)
    tar -C "$PWD" --exclude=./.venv --exclude=./runs --exclude=./.git -cf - . | tar -C "$Q/repo" -xf -
    export PYTHONPATH="$Q/repo:$Q/repo/edge_sdk" FL_DATA_DIR="${FL_DATA_DIR:-$Q/repo/.gpu_data}"
    export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 QUEUE_DIR=$Q MAX_JOBS MIN_FREE_MB DEVICE=${DEVICE:-cuda}
    # MPS lets the rows' small kernels share the GPU instead of time-slicing it; skipped when it does not start
    export CUDA_MPS_PIPE_DIRECTORY="$Q/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$Q/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if ! { nvidia-cuda-mps-control -d 2>/dev/null \
           && timeout 60 python3 -c "import torch; torch.zeros(1, device='cuda')" 2>/dev/null; }; then
        echo quit | nvidia-cuda-mps-control 2>/dev/null
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        echo "MPS off"
    fi
    setsid nohup bash "$0" _queue > "$Q/queue.log" 2>&1 < /dev/null &
    echo "queue started: $(wc -l < "$Q/jobs.txt") rows, logs in $Q/logs"
    ;;
_queue)
    queue
    ;;
status)
    echo "== $(date -u +%T), $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null)"
    for f in "$Q"/done/*; do [ -e "$f" ] && echo "done $(basename "$f"): exit, seconds = $(cat "$f")"; done
    for m in $(find "$Q/runs" -name metrics.jsonl 2>/dev/null | sort); do
        echo "round $(tail -1 "$m" | sed 's/.*"round": \([0-9]*\).*/\1/') ${m#"$Q/runs/"}"
    done
    grep -l Traceback "$Q"/logs/*.log 2>/dev/null | while read -r l; do echo "--- $l"; tail -3 "$l"; done
    mkdir -p "${OUT:-$Q/out}"
    tar czf "${OUT:-$Q/out}/results.tgz" -C "$Q" results logs done queue.log 2>/dev/null
    ;;
*)
    sed -n '2,20p' "$0"; exit 2
    ;;
esac
