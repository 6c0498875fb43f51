#!/usr/bin/env bash
# Build the coordinator image and prove it works here: `docker build`, `docker run` (non-root, healthcheck,
# /data volume), a device joins the container and streams, a restart keeps the state. Usage:
#   scripts/docker_verify.sh 2>&1 | tee docs/docker-verify.log
# Without Docker Hub the base image is built locally from Debian packages (scripts/build_local_base_image.sh);
# WHEELS=1 (default) pre-builds the Python wheels on the host into docker/wheels/ so the image installs offline.
set -euo pipefail
IMAGE=${IMAGE:-fl-edge-coordinator:local}
BASE=${BASE:-python:3.11-slim}
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8000}
ROUNDS=${ROUNDS:-20}
NAME=fl-edge-verify
VOLUME=fl-edge-verify-store
step() { echo; echo "### $* ($(date -u +%H:%M:%S) UTC)"; }

step "base image"
if docker image inspect "$BASE" >/dev/null 2>&1 || timeout 60 docker pull -q "$BASE" >/dev/null 2>&1; then
  echo "using $BASE"
else
  echo "$BASE cannot be pulled (no Docker Hub here): building an equivalent from Debian packages"
  BASE=fl-edge/python:3.11-slim-local
  docker image inspect "$BASE" >/dev/null 2>&1 || scripts/build_local_base_image.sh "$BASE"
  docker image ls "$BASE" --format '{{.Repository}}:{{.Tag}} {{.Size}}'
fi

if [ "${WHEELS:-1}" = 1 ] && ! ls docker/wheels/torch-*.whl >/dev/null 2>&1; then
  step "wheelhouse (host pip -> docker/wheels)"
  "$PY" -m pip wheel -q --wheel-dir docker/wheels "torch==2.13.0" "setuptools>=77" wheel ./edge_sdk .
  rm -f docker/wheels/fl_edge-*.whl docker/wheels/edge_sdk-*.whl  # the image builds these from source
fi
ls docker/wheels/*.whl 2>/dev/null | wc -l | xargs echo "wheels for an offline install:"

step "docker build"
docker build -q --build-arg BASE_IMAGE="$BASE" -t "$IMAGE" . | tail -1
docker image ls "$IMAGE" --format '{{.Repository}}:{{.Tag}} {{.Size}}'
docker image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "image size: %.0f MB (limit 900 MB)\n", $1 / 1e6}'
docker run --rm --entrypoint python "$IMAGE" -c "import importlib.util as u; \
print('installed in the runtime venv:', {m: u.find_spec(m) is not None for m in \
('torch', 'onnxruntime', 'scipy', 'sympy', 'matplotlib', 'sklearn', 'pip')})"

step "docker run (fresh volume)"
docker rm -f "$NAME" >/dev/null 2>&1 || true
docker volume rm "$VOLUME" >/dev/null 2>&1 || true
docker run -d --name "$NAME" -p "$PORT:8000" -e FL_SERVE_ROUNDS="$ROUNDS" -v "$VOLUME:/data" "$IMAGE" >/dev/null
trap 'docker rm -f "$NAME" >/dev/null 2>&1; docker volume rm "$VOLUME" >/dev/null 2>&1 || true' EXIT
echo "user inside: $(docker exec "$NAME" id)"
for _ in $(seq 1 60); do
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ] && break
  sleep 2
done
echo "health: $(docker inspect -f '{{.State.Health.Status}}' "$NAME")"
"$PY" -c "import httpx; print('healthz:', httpx.get('http://127.0.0.1:$PORT/healthz').text)"
# devices pin the signing key, read from the container's store (the operator's channel), not trusted on first use
FL_SIGNING_PUBLIC_KEY=$(docker exec "$NAME" python -c "from pathlib import Path; from fl_server.signing import ManifestSigner; print(ManifestSigner.load_or_create(Path('/data')).public_hex)")
export FL_SIGNING_PUBLIC_KEY
# joining needs an enrollment token (the image's default): the operator issues one with the admin token
FL_ENROLLMENT_TOKEN=$("$PY" -c "import httpx, sys; print(httpx.post('http://127.0.0.1:$PORT/v1/enrollments', json={'uses': 2}, headers={'Authorization': 'Bearer ' + sys.argv[1]}).json()['token'])" "$(docker exec "$NAME" cat /data/admin_token)")
export FL_ENROLLMENT_TOKEN  # examples/stream_inference.py reads it

for m in tent odpfl-hn; do
  step "a device joins the container and streams (--method $m)"
  "$PY" -m fl_server.cli device-data "http://127.0.0.1:$PORT" --method "$m" --wait 1800 --out "runs/docker-$m.npz"
  "$PY" examples/stream_inference.py --server "http://127.0.0.1:$PORT" --method "$m" --data "runs/docker-$m.npz" \
    --cache runs/docker-device-cache --png "runs/docker-stream-$m.png" | grep -v '^  \['
done

step "restart the container: state survives"
before=$("$PY" -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/healthz').text)")
docker restart "$NAME" >/dev/null
for _ in $(seq 1 60); do
  "$PY" -c "import httpx; httpx.get('http://127.0.0.1:$PORT/healthz', timeout=2)" 2>/dev/null && break
  sleep 1
done
after=$("$PY" -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/healthz').text)")
echo "before: $before"
echo "after:  $after"
"$PY" -c "import httpx; m = httpx.get('http://127.0.0.1:$PORT/v1/manifest').json(); print('manifest after restart:', m['method'], m['bundle_id'][:16])"
docker logs "$NAME" 2>&1 | tail -5
step "done"
