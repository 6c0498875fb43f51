#!/bin/sh
# Build-stage check of the trimmed venv (docker/slim_venv.sh): the coordinator's imports, the embedded digits, one
# training round and an ONNX export work, and neither matplotlib nor scikit-learn is installed. As bytecode is
# written here, the runtime image gets .pyc files for exactly the modules serving and training load.
set -eu
VENV=${1:?usage: smoke.sh VENV}
WORK=$(mktemp -d)
cd "$WORK"
"$VENV/bin/python" - <<'PY'
import importlib.util
import fl_server.service.app, fl_server.cli, edge_sdk, uvicorn  # noqa: F401  (serving's imports)
import numpy as np
import scipy.fft, scipy.interpolate, scipy.ndimage, scipy.signal, scipy.special  # noqa: F401  (kept by slim_venv.sh)
from edge_sdk import _btfl as btfl, _fedthe as fedthe  # noqa: F401  (numpy only)
from fl_server.data import load_dataset
assert len(load_dataset("digits")) == 1797
assert np.allclose(scipy.signal.lfilter([1.0], [1.0, -0.5], np.ones(3)), [1.0, 1.5, 1.75])
absent = [m for m in ("matplotlib", "sklearn", "pip") if importlib.util.find_spec(m) is not None]
assert not absent, f"should not be in the runtime venv: {absent}"
PY
"$VENV/bin/fl-server" train --dataset digits --method TENT --rounds 1 --out "$WORK/run" --no-progress > "$WORK/train.log"
"$VENV/bin/fl-server" export "$WORK/run" --out "$WORK/bundle" > "$WORK/export.log"
ls "$WORK/bundle" | grep -q manifest.json
echo "smoke: imports, digits, 1 training round and an ONNX export: ok"
cd / && rm -rf "$WORK"
