#!/usr/bin/env bash
# Screenshot of the coordinator dashboard in a real headless Chromium -> docs/dashboard.png.
#   scripts/dashboard_screenshot.sh [STORE]   (default runs/store, the store `make run` fills)
# Needs chromium (apt-get install -y chromium). Starts `fl-server serve` on STORE, waits until every job
# has finished, screenshots `/`, checks that the PNG is not blank, stops the server.
set -euo pipefail
STORE=${1:-runs/store}
BIN=${BIN:-.venv/bin}
PORT=${PORT:-8011}
OUT=${OUT:-docs/dashboard.png}
URL="http://127.0.0.1:$PORT"
CHROME=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$CHROME" ] || { echo "no Chromium found: apt-get install -y chromium"; exit 1; }
"$BIN/fl-server" serve --port "$PORT" --store "$STORE" --log-level warning > runs/dashboard-server.log 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
"$BIN/python" - "$URL" <<'PY'
import sys, time, httpx
url = sys.argv[1]
for _ in range(600):
    try:
        h = httpx.get(f"{url}/healthz", timeout=2).json()
        if h["bundles"] and not h["jobs"]["queued"] and not h["jobs"]["running"]:
            print("coordinator:", h)
            break
    except httpx.TransportError:
        pass
    time.sleep(1)
else:
    sys.exit("jobs did not finish")
PY
"$CHROME" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1000 \
  --screenshot="$OUT" "$URL/" 2>/dev/null
"$BIN/python" - "$OUT" <<'PY'
import sys
import matplotlib.image as mpimg
img = mpimg.imread(sys.argv[1])
print(f"{sys.argv[1]}: {img.shape[1]}x{img.shape[0]} px, {img[..., :3].std():.3f} pixel std (0 = blank)")
assert img[..., :3].std() > 0.01, "blank screenshot"
PY
