# Sourced by device_session.sh and gpu_engine_session.sh: the end of a lease's rows. Reads the caller's start,
# Q (the rows' folder), O (the call's $OUT), LOG and say.

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
