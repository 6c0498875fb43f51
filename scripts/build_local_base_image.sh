#!/usr/bin/env bash
# Build a local stand-in for the `python:3.11-slim` base image from Debian packages, for machines that reach
# Debian's and Python's package registries but not Docker Hub. debootstrap (minbase) of Debian bookworm,
# whose python3 is 3.11, plus venv (with ensurepip's pip wheel; no system pip) and CA certificates; imported into
# Docker as $TAG.
#   sudo scripts/build_local_base_image.sh [TAG]     (needs root, debootstrap and a running dockerd)
# Then: docker build --build-arg BASE_IMAGE=$TAG -t fl-edge-coordinator .
set -euo pipefail
TAG=${1:-fl-edge/python:3.11-slim-local}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap"; exit 1; }
ROOT=$(mktemp -d -t fl-edge-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
echo "debootstrap $SUITE ($MIRROR) -> $ROOT"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$ROOT" "$MIRROR" > "$ROOT.log" 2>&1 || { tail -20 "$ROOT.log"; exit 1; }
ln -sf python3 "$ROOT/usr/bin/python"
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* \
  "$ROOT"/usr/share/locale/* "$ROOT"/usr/share/info/*
tar -C "$ROOT" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$TAG" > /dev/null
rm -f "$ROOT.log"
docker run --rm "$TAG" python3 -c "import sys, ssl, venv; print('base image ready:', sys.version.split()[0])"
docker image ls "$TAG" --format '{{.Repository}}:{{.Tag}} {{.Size}}'
