#!/usr/bin/env bash
# The device side alone: a fresh venv with only `pip install ./edge_sdk` must get neither torch nor scipy, must
# import edge_sdk without torch, and, with pytest added and scipy still absent, must pass the SDK's own tests
# (edge_sdk/tests: every device method, BTFL and FedTHE included) against bundles and torch reference outputs
# exported beforehand by the coordinator's environment ($MAIN_PYTHON edge_sdk/tests/sdk_fixture.py).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
main_python=${MAIN_PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=$work/sdk-venv
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/pip" install -q "$here/edge_sdk"
if "$venv/bin/pip" show torch >/dev/null 2>&1; then echo "FAIL: torch was installed by edge_sdk"; exit 1; fi
# the distribution is fl-edge-sdk (import name edge_sdk): "edge-sdk" on PyPI is an unrelated project
"$venv/bin/pip" show fl-edge-sdk >/dev/null || { echo "FAIL: ./edge_sdk did not install as fl-edge-sdk"; exit 1; }
(cd "$work" && "$venv/bin/python" -c "import edge_sdk, sys; assert 'torch' not in sys.modules; print('edge_sdk', edge_sdk.__version__, 'imports without torch')")
if "$venv/bin/pip" show scipy >/dev/null 2>&1; then echo "FAIL: scipy was installed by edge_sdk"; exit 1; fi
"$venv/bin/pip" list --format=freeze | sed 's/^/  /'
# what the device SDK weighs installed: edge_sdk and its dependencies (not pip, setuptools)
"$venv/bin/python" - <<'PY'
import importlib.metadata as md, pathlib
skip = {"pip", "setuptools"}
total = 0
for dist in md.distributions():
    if dist.metadata["Name"].lower() not in skip:
        total += sum(pathlib.Path(dist.locate_file(f)).stat().st_size for f in dist.files or ()
                     if pathlib.Path(dist.locate_file(f)).is_file())
print(f"edge_sdk installed with its dependencies: {total / 2**20:.0f} MiB")
PY
# the only test dependency; the tests run without scipy (edge_sdk/tests skip their scipy cross-checks and keep
# committed reference values), so a device method that still needs it fails here
"$venv/bin/pip" install -q "pytest>=8"
"$venv/bin/python" -c "import importlib.util as u, sys; sys.exit('FAIL: scipy is importable in the SDK venv; the \
device tests must run without it' if u.find_spec('scipy') is not None else None)"
(cd "$here" && FL_DATA_DIR=${FL_DATA_DIR:-$(cd "$here/.." && pwd)/shared/data} "$main_python" edge_sdk/tests/sdk_fixture.py "$work/fixture")
cd "$work" && EDGE_SDK_FIXTURE="$work/fixture" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$here/edge_sdk/tests"
# the device examples with edge_sdk alone, against a real coordinator (the coordinator side uses $main_python)
MAIN_PYTHON=$main_python bash "$here/scripts/run_device_examples.sh" "$venv/bin/python" "$work/examples"
