#!/usr/bin/env bash
# `make run`: bring the coordinator up on the embedded default (it trains TENT, FedTTA++, ODPFL-HN and BTFL on
# the 8x8 digits in the background and serves their bundles), then run the streaming device example against it
# for each method, then stop the coordinator. State persists in $STORE: a second run reuses the bundles.
set -euo pipefail
BIN=${BIN:-.venv/bin}
PORT=${PORT:-8000}
STORE=${STORE:-runs/store}
export FL_SERVE_WORKERS=${FL_SERVE_WORKERS:-2}  # two training jobs at a time
# a local trial on loopback: anyone may join without an enrollment token (never where untrusted devices reach it)
export FL_SERVE_ENROLLMENT=${FL_SERVE_ENROLLMENT:-open}
METHODS=${METHODS:-"tent fedtta++ odpfl-hn btfl none"}
URL="http://127.0.0.1:${PORT}"
mkdir -p runs
"$BIN/fl-server" serve --port "$PORT" --store "$STORE" --log-level warning > runs/coordinator.log 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  if "$BIN/python" -c "import httpx,sys; sys.exit(httpx.get('$URL/healthz', timeout=2).status_code != 200)" 2>/dev/null; then
    break
  fi
  kill -0 "$SERVER" 2>/dev/null || { echo "coordinator exited; see runs/coordinator.log"; tail -20 runs/coordinator.log; exit 1; }
  sleep 0.5
done
# the device pins the coordinator's signing key, read from the store this script owns (not trusted on first use)
export FL_SIGNING_PUBLIC_KEY=$("$BIN/python" -c "import sys; from pathlib import Path; from fl_server.signing import ManifestSigner; print(ManifestSigner.load_or_create(Path(sys.argv[1])).public_hex)" "$STORE")
echo "coordinator up at $URL (dashboard $URL/, API docs $URL/docs, log runs/coordinator.log);"
echo "waiting for its default bundles (training on the embedded digits; progress on the dashboard) ..."
for m in $METHODS; do
  echo "=== streaming device, --method $m"
  # the device's samples are prepared on the coordinator's side (the example imports edge_sdk only)
  "$BIN/fl-server" device-data "$URL" --method "$m" --wait 1800 --out "runs/device-$m.npz"
  "$BIN/python" examples/stream_inference.py --server "$URL" --method "$m" --data "runs/device-$m.npz"
done
