#!/usr/bin/env bash
# A Docker daemon of CI's own, so the sandbox tests run every case on Docker as well as bubblewrap.
#
#   .ci/docker-daemon.sh start DIR   install docker.io and debootstrap if missing (Debian), start
#                                    dockerd with its data, exec root and socket under DIR, wait for
#                                    it, build the sandbox image (.ci/docker-image.sh); print the
#                                    DOCKER_HOST value on stdout. Progress goes to stderr. When any
#                                    step fails: one line "docker: ..." on stderr saying why, exit 1.
#   .ci/docker-daemon.sh stop DIR    stop that daemon (and the containerd it started), remove DIR.
#
# The daemon needs no network: --bridge=none and --iptables=false (sandboxes run with network
# "none"), and images are built offline. DOCKERD_WAIT_S (default 30): how long to wait for it to
# answer. Logs: DIR/apt.log, DIR/dockerd.log, DIR/image.log.
set -euo pipefail

action="${1:-}" dir="${2:-}"
[ -n "$dir" ] && [ "$action" = start -o "$action" = stop ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
dir="$(realpath -m "$dir")"
sock="$dir/docker.sock" wait_s="${DOCKERD_WAIT_S:-30}"
cd "$(dirname "$0")/.."

fail() { echo "docker: $*; the Docker sandbox cases will skip" >&2; halt; exit 1; }
last_line() { grep -v '^\s*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-200 | sed 's/^/: /'; }  # ": LINE", or nothing
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f s", b - a }'; }

start() {
    local t0 t1 t2 t3 pid
    t0="$(now)"
    [ "$(id -u)" = 0 ] || fail "not root, cannot start a daemon"
    mkdir -p "$dir"
    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap \
            >"$dir/apt.log" 2>&1 || fail "apt-get install docker.io debootstrap failed$(last_line "$dir/apt.log")"
    fi
    t1="$(now)"
    setsid dockerd --data-root "$dir/data" --exec-root "$dir/exec" -H "unix://$sock" \
        --pidfile "$dir/dockerd.pid" --bridge=none --iptables=false --ip-masq=false --log-level=warn \
        </dev/null >"$dir/dockerd.log" 2>&1 &
    pid=$!
    echo "$pid" >"$dir/daemon.pid"  # setsid execs dockerd in place: this is the daemon's pid
    for _ in $(seq "$((wait_s * 10))"); do
        DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1 && break
        kill -0 "$pid" 2>/dev/null || fail "dockerd exited$(last_line "$dir/dockerd.log")"
        sleep 0.1
    done
    DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1 \
        || fail "dockerd did not answer within $wait_s s$(last_line "$dir/dockerd.log")"
    t2="$(now)"
    DOCKER_HOST="unix://$sock" .ci/docker-image.sh >"$dir/image.log" 2>&1 \
        || fail "building the sandbox image failed$(last_line "$dir/image.log")"
    t3="$(now)"
    echo "docker: install $(secs "$t0" "$t1"), daemon start $(secs "$t1" "$t2"), image build $(secs "$t2" "$t3");" \
        "DOCKER_HOST=unix://$sock" >&2
    echo "unix://$sock"
}

# Stop the daemon started in DIR, if it runs; DIR and its logs stay.
halt() {
    local pid
    if [ -f "$dir/daemon.pid" ] && pid="$(cat "$dir/daemon.pid")" && kill -0 "$pid" 2>/dev/null; then
        # Containers first, while the daemon still answers; then the daemon, which stops its containerd.
        DOCKER_HOST="unix://$sock" docker ps -aq --filter label=agent-rl 2>/dev/null \
            | xargs -r env DOCKER_HOST="unix://$sock" docker rm -f >/dev/null 2>&1 || true
        kill -TERM "$pid"
        for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done  # 20 s
        if kill -0 "$pid" 2>/dev/null; then  # still there: it and the containerd it started, by pid
            kill -KILL "$pid" $(cat "$dir/exec/containerd/containerd.pid" 2>/dev/null) 2>/dev/null || true
        fi
    fi
}

stop() {
    local t0
    [ -d "$dir" ] || return 0
    t0="$(now)"
    halt
    # Whatever a killed daemon left mounted under DIR, deepest first, then the files.
    awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r \
        | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf --one-file-system "$dir"
    echo "docker: stopped and removed in $(secs "$t0" "$(now)")" >&2
}

"$action"
