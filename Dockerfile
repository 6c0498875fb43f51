# The fl-edge coordinator: `docker run -p 8000:8000 IMAGE` trains the default bundles on the embedded digits
# (first start) and serves them. State (SQLite, artifacts, job runs) lives in the /data volume.
#   docker build -t fl-edge-coordinator .                                   # CPU torch (default)
#   docker build --build-arg BASE_IMAGE=<a CUDA 12.8 runtime image with python3 and python3-venv> \
#                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t fl-edge-coordinator:cuda .
#   (no Docker Hub? scripts/build_local_base_image.sh builds an equivalent base from Debian packages;
#    wheels placed in docker/wheels/ are installed offline, see scripts/docker_verify.sh)
ARG BASE_IMAGE=python:3.11-slim

# ---- build stage: a venv with torch, the coordinator and edge_sdk (wheels and sources stay behind), trimmed
#      by docker/slim_venv.sh (no pip, no test suites, headers or torch's C++ SDK); no matplotlib or
#      scikit-learn (not dependencies of serving or training: the digits ship as fl_server/data/digits.npz);
#      the coordinator requires the SDK (distribution fl-edge-sdk) by path, from ./edge_sdk, never from an index
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY docker/wheels/ /tmp/wheels/
COPY docker/slim_venv.sh docker/smoke.sh /tmp/
COPY pyproject.toml setup.py README.md LICENSE ./
COPY edge_sdk/ ./edge_sdk/
COPY fl_server/ ./fl_server/
RUN python3 -m venv /opt/venv \
 && if ls /tmp/wheels/*.whl >/dev/null 2>&1; then SRC="--no-index --find-links /tmp/wheels"; \
    else SRC="--extra-index-url ${TORCH_INDEX}"; fi \
 && /opt/venv/bin/pip install $SRC "torch==2.13.0" . \
 && (command -v strip >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends binutils \
     >/dev/null) || echo "no binutils (apt unreachable): shared libraries stay unstripped") \
 && sh /tmp/slim_venv.sh /opt/venv \
 && OMP_NUM_THREADS=1 sh /tmp/smoke.sh /opt/venv \
 && cd /opt/venv/lib/python3*/site-packages \
 && find sympy networkx onnxscript onnx_ir torch/_dynamo torch/_inductor torch/onnx torch/export \
      -depth -type d -name __pycache__ -exec rm -rf {} +
# (the last line: bytecode of the packages only the ONNX export loads, 34 MB, goes again: each export compiles
#  them, a few seconds)

# ---- runtime stage
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH FL_SERVE_ROUNDS=60 OMP_NUM_THREADS=1
COPY --from=build /opt/venv /opt/venv
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin fl && mkdir -p /data && chown fl /data
USER fl
WORKDIR /home/fl
VOLUME /data
EXPOSE 8000
# loopback health probe: plain HTTP, or HTTPS when FL_TLS_CERT is set (the certificate names the public host, so
# the probe does not check it; devices do)
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD python -c "import httpx, os, sys; s = 'https' if os.environ.get('FL_TLS_CERT') else 'http'; sys.exit(httpx.get(s + '://127.0.0.1:8000/healthz', timeout=2, verify=False).status_code != 200)"
# TLS: mount the certificate and key and name them, e.g.
#   docker run -p 8443:8000 -v $PWD/tls:/tls:ro -e FL_TLS_CERT=/tls/cert.pem -e FL_TLS_KEY=/tls/key.pem IMAGE
# (fl-server serve reads --tls-cert/--tls-key from them); without them it serves plain HTTP and warns
CMD ["fl-server", "serve", "--host", "0.0.0.0", "--port", "8000", "--store", "/data"]
