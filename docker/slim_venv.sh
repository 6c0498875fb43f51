#!/bin/sh
# Trim the coordinator's venv for the runtime image (run in the Dockerfile's build stage): what serving,
# training and ONNX export never load. Every removal is checked afterwards by the build stage's smoke test
# (imports, a tiny train + export). Usage: docker/slim_venv.sh /opt/venv
set -eu
VENV=${1:?usage: slim_venv.sh VENV}
SP=$(echo "$VENV"/lib/python3*/site-packages)
# the installers: the image never installs anything
"$VENV/bin/python" -m pip uninstall -y -q pip setuptools wheel 2>/dev/null || true
# torch: C++ headers, CMake files, test binaries and data, the protobuf compiler (torch_shm_manager stays:
# torch.multiprocessing's shared-memory manager)
rm -rf "$SP/torch/include" "$SP/torch/share" "$SP/torch/test" "$SP/torch/lib/libtorchbind_test.so"
find "$SP/torch/bin" -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +
# every package's own test suite and the ONNX backend's test data
find "$SP" -depth -type d \( -name tests -o -name testing_data \) -path '*/site-packages/*/*' \
  ! -path '*/torch/testing*' ! -path '*/numpy/testing*' -exec rm -rf {} +
rm -rf "$SP/onnx/backend"
# subpackages nothing here imports (scipy.signal / ndimage / fft / special / interpolate and sympy's core stay;
# docker/smoke.sh imports them): about 10 MB
rm -rf "$SP/scipy/io" "$SP/scipy/odr" "$SP/scipy/cluster" "$SP/scipy/datasets" "$SP/scipy/misc" \
  "$SP/sympy/physics" "$SP/sympy/stats"
# type stubs and headers that only build tools read
find "$SP" -type f \( -name '*.pyi' -o -name '*.h' -o -name '*.hpp' -o -name '*.c' -o -name '*.pxd' \) -delete
find "$SP" -depth -type d -name include -path '*/numpy/*' -exec rm -rf {} +
# torch's symbol tables (libtorch_cpu.so alone: 415 -> 345 MB), where binutils' strip exists (the Dockerfile
# installs it in the build stage when apt can reach a mirror; otherwise this is skipped). Only torch/lib: the
# auditwheel-repaired libraries of other wheels (*.libs/, patched by patchelf) no longer load once stripped.
if command -v strip >/dev/null 2>&1; then
  find "$SP/torch/lib" -name '*.so*' -type f -exec strip --strip-unneeded {} +
fi
# bytecode: pip compiled every module (about 150 MB); drop it all, and docker/smoke.sh, which runs serving's
# imports, a training run and an export, then compiles again just the modules those load
find "$VENV" -depth -type d -name __pycache__ -exec rm -rf {} +
du -sm "$VENV" | sed 's/^/venv MB: /'
