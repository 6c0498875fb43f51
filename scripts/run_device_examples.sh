#!/usr/bin/env bash
# The device examples in a venv that holds edge_sdk alone (no torch, no fl_server), against a real coordinator:
#   scripts/run_device_examples.sh SDK_PYTHON WORKDIR
# The coordinator side ($MAIN_PYTHON, default .venv/bin/python) serves a TENT bundle trained on the embedded
# digits and writes the device's samples (fl-server device-data); the device side (SDK_PYTHON) runs
# examples/stream_inference.py, then examples/personalize_on_device.py on the bundle it downloaded and verified.
# Called by scripts/check_edge_sdk_venv.sh (make test-sdk).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
sdk_python=$1
work=$2
main_python=${MAIN_PYTHON:-$here/.venv/bin/python}
mkdir -p "$work"
port=$("$main_python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
url="http://127.0.0.1:$port"
(cd "$here" && FL_SERVE_DEFAULT_METHODS=TENT FL_SERVE_ROUNDS=2 FL_SERVE_WORKERS=1 OMP_NUM_THREADS=1 FL_SERVE_ENROLLMENT=open \
  exec "$main_python" -m fl_server.cli serve --port "$port" --store "$work/store" --log-level warning) \
  > "$work/coordinator.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  "$main_python" -c "import httpx, sys; sys.exit(httpx.get('$url/healthz', timeout=2).status_code != 200)" \
    2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "FAIL: coordinator exited"; tail -20 "$work/coordinator.log"; exit 1; }
  sleep 0.5
done
key=$("$main_python" -c "import httpx; print(httpx.get('$url/v1/signing-key', timeout=10).json()['public_key'])")

# coordinator side: the device's samples
(cd "$here" && "$main_python" -m fl_server.cli device-data "$url" --method TENT --wait 600 --per-phase 60 \
  --out "$work/stream.npz")
# device side: edge_sdk only
cd "$work"
"$sdk_python" "$here/examples/stream_inference.py" --server "$url" --method tent --public-key "$key" \
  --data "$work/stream.npz" --cache "$work/device-cache" --json "$work/stream.json" --print-every 60
"$sdk_python" - "$work/stream.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["torch_imported"] is False and s["fl_server_imported"] is False, s
assert s["samples"] == 180 and s["accuracy_received_model"]["in-distribution"] > 20, s  # chance: 10
print("stream_inference.py ran on edge_sdk alone:", s["accuracy"])
PY
bundle=$(dirname "$(ls "$work"/device-cache/bundles/*/manifest.sig | head -1)")
(cd "$here" && "$main_python" -m fl_server.cli device-data "$bundle" --kind clients --out "$work/clients.npz")
"$sdk_python" "$here/examples/personalize_on_device.py" --bundle "$bundle" --public-key "$key" \
  --data "$work/clients.npz" | tee "$work/personalize.txt"
grep -q "signature checked" "$work/personalize.txt"
grep -q "torch imported: False; fl_server imported: False" "$work/personalize.txt"
echo "personalize_on_device.py ran on edge_sdk alone"

# your own model and data (examples/custom_model.py): trained, exported and published on this side, the device
# (examples/custom_model_device.py) on edge_sdk alone; needs the real Fashion-MNIST files
export FL_DATA_DIR=${FL_DATA_DIR:-$(cd "$here/.." && pwd)/shared/data}
if [ -d "$FL_DATA_DIR/fashion-mnist" ] || [ -d "$FL_DATA_DIR/fashion_mnist" ]; then
  start=$SECONDS
  (cd "$here" && OMP_NUM_THREADS=1 "$main_python" examples/custom_model.py --work "$work/custom" \
    --device-python "$sdk_python" --json "$work/custom.json")
  "$sdk_python" - "$work/custom.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["torch_imported"] is False and s["fl_server_imported"] is False, s
assert [r["method"] for r in s["results"]] == ["TENT", "FedTTA"], s
assert all(r["preprocess"]["layout"] == "NHWC" for r in s["results"]), s  # the device got raw uint8 images
assert s["results"][0]["accuracy_received"] > 25, s  # chance: 10
PY
  echo "custom_model.py ran end to end in $((SECONDS - start))s (device part on edge_sdk alone)"
else
  echo "custom_model.py skipped: no Fashion-MNIST in $FL_DATA_DIR"
fi
