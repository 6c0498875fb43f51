#!/usr/bin/env bash
# pip install ./edge_sdk into a fresh venv and check that torch is neither installed nor imported.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$(mktemp -d)/sdk-venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q "$here/edge_sdk"
if "$venv/bin/pip" show torch >/dev/null 2>&1; then echo "FAIL: torch was installed by edge_sdk"; exit 1; fi
(cd "$(dirname "$venv")" && "$venv/bin/python" -c "import edge_sdk, sys; assert 'torch' not in sys.modules; print('edge_sdk', edge_sdk.__version__, 'imports without torch')")
"$venv/bin/pip" list --format=freeze | sed 's/^/  /'
rm -rf "$(dirname "$venv")"
