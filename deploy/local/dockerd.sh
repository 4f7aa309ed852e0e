#!/usr/bin/env bash
# Prints a DOCKER_HOST that answers, for `make compose-smoke`: the environment's or the default
# daemon's when one runs, else a private dockerd started here. Its data root, exec root, socket and
# log are under T2I_DOCKERD_DIR (default /var/tmp/t2i-dockerd; its image cache is kept there between
# runs), and it runs without iptables rules or a default bridge, so it changes nothing else on the
# machine (compose's own networks still carry the containers' traffic; ports publish on 127.0.0.1
# through docker-proxy). Where no dockerd is installed, installs Debian's docker.io (as root).
# Stop it with: kill "$(cat /var/tmp/t2i-dockerd/pid)".
set -euo pipefail
DIR="${T2I_DOCKERD_DIR:-/var/tmp/t2i-dockerd}"
SOCK="unix://$DIR/docker.sock"
answers() { DOCKER_HOST="$1" docker info >/dev/null 2>&1; }
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    echo "${DOCKER_HOST:-unix:///var/run/docker.sock}"
    exit 0
fi
if command -v docker >/dev/null && answers "$SOCK"; then
    echo "$SOCK"
    exit 0
fi
if ! command -v dockerd >/dev/null; then
    echo "dockerd.sh: installing docker.io from Debian's packages" >&2
    apt-get install -y -q docker.io >&2 || { apt-get update -q >&2 && apt-get install -y -q docker.io >&2; }
fi
mkdir -p "$DIR"
echo "dockerd.sh: starting a private dockerd on $SOCK (log: $DIR/dockerd.log)" >&2
nohup dockerd --data-root "$DIR/root" --exec-root "$DIR/exec" -H "$SOCK" --pidfile "$DIR/pid" \
    --iptables=false --bridge=none >>"$DIR/dockerd.log" 2>&1 &
for _ in $(seq 1 60); do
    if answers "$SOCK"; then
        echo "$SOCK"
        exit 0
    fi
    sleep 1
done
echo "dockerd.sh: dockerd did not answer on $SOCK within 60 s (see $DIR/dockerd.log)" >&2
exit 1
