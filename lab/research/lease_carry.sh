#!/usr/bin/env bash
# Prepare this checkout for one GPU-lease call of gpu_engine_session.sh, and undo it after. A call carries the
# working tree (tracked and untracked files) plus the carried folders, 64 MiB in all; the committed result files
# (docs/results, about 25 MB) are not needed there, so they step aside to $ASIDE for the call.
#   bash lab/research/lease_carry.sh prepare          # .gpu_data <- fashion-mnist (the rows' data); results aside
#   bash lab/research/lease_carry.sh prepare --tests  # ... and mnist (tests/test_gpu_engine.py's data)
#   (the call: carry [".gpu_data"]; the tracked lab/research/lease-checkpoints travel with the tree)
#   bash lab/research/lease_carry.sh restore          # docs/results back
# prepare prints what the call will carry and refuses (exit 1, results restored) when it exceeds 64 MiB.
set -euo pipefail
DATA=${FL_DATA_DIR:-../shared/data}
ASIDE=${ASIDE:-${TMPDIR:-/tmp}/lease-aside}
LIMIT=$(( 64 * 1024 * 1024 ))

restore() {
    if [ -d "$ASIDE/results" ]; then
        [ ! -e docs/results ] || { echo "docs/results exists and $ASIDE/results too: resolve by hand" >&2; exit 1; }
        mv "$ASIDE/results" docs/results
        echo "docs/results restored"
    fi
}

carried_bytes() {  # the working tree as a call copies it (tracked + untracked, not ignored; files stepped aside
    # are missing and not counted) and the carried folders
    { git ls-files -z --cached --others --exclude-standard; find .gpu_data -type f -print0 2>/dev/null; } |
        { xargs -0 -r du -bcL 2>/dev/null || true; } | awk '$2 == "total" {s += $1} END {print s + 0}'
}

case "${1:-}" in
prepare)
    mkdir -p .gpu_data "$ASIDE"
    cp -r "$DATA/fashion-mnist" .gpu_data/
    if [ "${2:-}" = "--tests" ]; then cp -r "$DATA/mnist" .gpu_data/; fi
    [ ! -e "$ASIDE/results" ] || { echo "$ASIDE/results already holds results: restore first" >&2; exit 1; }
    mv docs/results "$ASIDE/results"
    total=$(carried_bytes)
    echo "the call carries $(( total / 1024 / 1024 )) MiB of 64 (docs/results aside in $ASIDE)"
    if [ "$total" -gt "$LIMIT" ]; then
        restore
        echo "over the limit: drop mnist (no --tests) or checkpoints from lab/research/lease-checkpoints" >&2
        exit 1
    fi
    ;;
restore) restore ;;
*) echo "usage: $0 prepare [--tests] | restore" >&2; exit 2 ;;
esac
