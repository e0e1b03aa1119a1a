# Sourced by `make image` and `make compose-test`: picks the container engine and its compose, and
# installs podman (from the distribution) when no working engine is present.
#
# Sets ENGINE (podman or docker) and COMPOSE (the compose command for it). For podman it writes
# build/containers.conf with the two settings some hosts need and exports CONTAINERS_CONF:
#   - runc as the runtime when it is installed (crun refuses hosts with hybrid cgroups);
#   - default ulimits no higher than the limits podman itself runs under: this shell's hard limit
#     of open files, and at most 32768 processes (podman lowers its own limit to that). Podman's
#     defaults (1048576 open files) fail with "setrlimit: Operation not permitted" where root
#     lacks CAP_SYS_RESOURCE.
# A podman user on such a host exports the same CONTAINERS_CONF before calling podman-compose.

PODMAN_PACKAGES="podman runc conmon containernetworking-plugins golang-github-containernetworking-plugin-dnsname
iptables uidmap slirp4netns fuse-overlayfs catatonit"
PODMAN_COMPOSE_VERSION=1.6.0  # Debian's 1.0.3 ignores errors and exits 0

engine_works() { timeout 20 "$1" info >/dev/null 2>&1; }

install_podman() {
    command -v apt-get >/dev/null || { echo "no podman or docker, and no apt-get to install podman" >&2; return 1; }
    echo "== installing podman from the distribution"
    local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $PODMAN_PACKAGES >/dev/null
}

write_containers_conf() {
    local conf="$1" nofile nproc
    nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
    { [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
    mkdir -p "$(dirname "$conf")"
    {
        echo "# Written by .ci/container-engine.sh for this host; see the comment there."
        echo "[containers]"
        printf 'default_ulimits = [\n'
        [ "$nofile" = unlimited ] || printf '  "nofile=%s:%s",\n' "$nofile" "$nofile"
        [ "$nproc" = unlimited ] || printf '  "nproc=%s:%s",\n' "$nproc" "$nproc"
        printf ']\n'
        if command -v runc >/dev/null; then
            echo "[engine]"
            echo 'runtime = "runc"'
        fi
    } > "$conf"
}

pick_engine() {
    if [ -n "${ENGINE:-}" ]; then :
    elif command -v podman >/dev/null; then ENGINE=podman
    elif command -v docker >/dev/null && engine_works docker; then ENGINE=docker
    else install_podman && ENGINE=podman
    fi
    if [ "$ENGINE" = podman ]; then
        if [ -z "${CONTAINERS_CONF:-}" ]; then
            write_containers_conf "$PWD/build/containers.conf"
            export CONTAINERS_CONF="$PWD/build/containers.conf"
        fi
        engine_works podman || { echo "podman does not work here:" >&2; podman info >&2; return 1; }
    fi
    export ENGINE
}

# The compose command for ENGINE: docker's own plugin, else podman-compose (from PyPI, into $PY's
# environment when it is missing).
pick_compose() {
    if [ "$ENGINE" = docker ] && docker compose version >/dev/null 2>&1; then
        COMPOSE="docker compose"
        export COMPOSE
        return
    fi
    if [ "$ENGINE" = docker ]; then  # a docker without the compose plugin: podman and podman-compose instead
        echo "== docker has no compose plugin (docker compose v2): using podman"
        command -v podman >/dev/null || install_podman
        ENGINE=podman
        pick_engine
    fi
    if [ "$ENGINE" = podman ]; then
        local py="${PY:-python3}"
        if ! "$py" -c "import importlib.metadata as m; assert m.version('podman-compose') == '$PODMAN_COMPOSE_VERSION'" 2>/dev/null; then
            echo "== installing podman-compose $PODMAN_COMPOSE_VERSION"
            "$py" -m pip install -q "podman-compose==$PODMAN_COMPOSE_VERSION"
        fi
        COMPOSE="$py -m podman_compose"
    fi
    export COMPOSE
}
