# Sourced by device_queue.sh, device_session.sh and gpu_engine_session.sh: how a row's step runs, and the end of a
# lease's rows. The latter read the caller's start, Q (the rows' folder), O (the call's $OUT), LOG and say.

# the interpreter of a row's step (its words, after `eval "set -- $step"`) into the array STEP: `python3 -m lab` for
# a lab command (bench ...), `python3` for a research script's (lab/research/*.py ..., the gap-* rows); the callers
# append the same flags to either (--device, --no-progress, --results-dir, --runs-dir)
step_runner() {
    if [[ "$1" == lab/research/*.py ]]; then STEP=(python3); else STEP=(python3 -m lab); fi
}

# wait for the background rows, logging GPU use every $1 seconds (default 15) into $Q/logs/gpu.log
watch_rows() {
    while [ -n "$(jobs -r)" ]; do
        echo "$(( $(date +%s) - start )) s: $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)" \
            >> "$Q/logs/gpu.log"
        sleep "${1:-15}"
    done
    say "rows ended"
}

# every run's last metrics line into the log; logs, raw results, metrics and run files into $O/rows.tgz
pack_rows() {
    for m in $(find "$Q/runs" -name metrics.jsonl | sort); do
        echo "${m#"$Q/runs/"}: $(tail -1 "$m")" >> "$LOG"
    done
    (cd "$Q" && tar czf "$O/rows.tgz" logs results $(find runs -name metrics.jsonl -o -name '*.json'))
}
