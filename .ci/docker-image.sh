#!/usr/bin/env bash
# Build the Docker sandbox image (tools/sandbox_docker.py: IMAGE) without a registry:
# a minimal Debian rootfs with python3 and its whole standard library (python3-minimal lacks
# `resource`, which the session driver needs, and ctypes), made by debootstrap and loaded with
# `docker import`.
#
# Needs: root, a running daemon that `docker` reaches (set DOCKER_HOST for a non-default socket),
# and the Debian mirror this machine's apt uses (.ci/apt-mirror.sh reads it, and the suite, from
# /etc/apt; MIRROR and SUITE override them). Idempotent: does nothing when a working image exists
# (FORCE=1 rebuilds).
#
# Usage: [DOCKER_HOST=unix:///path/docker.sock] [IMAGE=agent-rl-python] [SUITE=codename] \
#        [MIRROR=http://host/debian] [FORCE=1] .ci/docker-image.sh
set -euo pipefail

IMAGE="${IMAGE:-agent-rl-python}"
if [ -z "${MIRROR:-}" ] || [ -z "${SUITE:-}" ]; then
    read -r apt_mirror apt_suite < <("$(dirname "$0")/apt-mirror.sh" || true) || true
    MIRROR="${MIRROR:-${apt_mirror:-}}" SUITE="${SUITE:-${apt_suite:-}}"
    [ -n "$MIRROR" ] && [ -n "$SUITE" ] \
        || { echo "error: no Debian mirror found in /etc/apt; set MIRROR and SUITE" >&2; exit 1; }
fi

docker info >/dev/null 2>&1 || { echo "error: no Docker daemon answers (DOCKER_HOST=${DOCKER_HOST:-unset})" >&2; exit 1; }

CHECK='import ctypes, json, resource, sys; print("image ok", sys.version.split()[0])'
if [ -z "${FORCE:-}" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    if docker run --rm --network none "$IMAGE" python3 -c "$CHECK" 2>/dev/null; then
        echo "$IMAGE already present: $(docker image inspect -f '{{.Id}}' "$IMAGE")"
        exit 0
    fi
    echo "$IMAGE exists but lacks python3 or its standard library; rebuilding" >&2
fi

if ! command -v debootstrap >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap
fi

rootfs="$(mktemp -d "${TMPDIR:-/tmp}/agent-rl-rootfs.XXXXXX")"
trap 'rm -rf --one-file-system "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3 "$SUITE" "$rootfs" "$MIRROR"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
chroot "$rootfs" python3 -c 'print("python3 ok")'
tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
    --change 'CMD ["python3"]' \
    - "$IMAGE"
docker run --rm --network none "$IMAGE" python3 -c "$CHECK"
