#!/usr/bin/env bash
# Builds a Debian base image locally, for hosts that cannot pull one from a registry:
#   .ci/bootstrap-base-image.sh ENGINE TAG
# mmdebstrap installs a minimal system with Python 3 from this host's own apt sources (so no
# mirror is named here), adds this host's extra CA certificates (/usr/local/share/ca-certificates:
# a TLS-intercepting proxy's, say), and the tarball is imported as TAG. The certificates are taken
# at build time and never stored in the repository. The suite is this host's release.
set -euo pipefail
engine=$1 tag=$2

command -v mmdebstrap >/dev/null || {
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq mmdebstrap >/dev/null
}
. /etc/os-release
suite=${VERSION_CODENAME:?this host names no release codename in /etc/os-release}

# Every enabled apt source of this host, one-line (.list) and deb822 (.sources) files alike.
sources=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && grep -qv '^\s*\(#\|$\)' "$f" && sources+=("$f")
done
[ ${#sources[@]} -gt 0 ] || { echo "no apt sources on this host" >&2; exit 1; }

certs=/usr/local/share/ca-certificates
mmdebstrap --quiet --variant=minbase --include=ca-certificates,python3,python3-venv \
    --customize-hook="if [ -d $certs ]; then cp -r $certs/. \"\$1$certs/\"; fi" \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$suite" - "${sources[@]}" |
  "$engine" import \
    --change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" \
    --change "ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt" \
    --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
    --change 'CMD ["python3"]' \
    - "$tag" >/dev/null
echo "bootstrapped $tag from $suite"
