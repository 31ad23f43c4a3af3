#!/usr/bin/env bash
# Installs promtool, which tests/dashboards uses to validate prometheus.yml, the rules and every
# PromQL query of the dashboards; with `prometheus` as an argument, the Prometheus server too,
# which the demo-alert test and dashboards/demo_alerts.py start on loopback. Binaries already on
# PATH are left alone.
#
# On Debian/Ubuntu it takes the binaries out of the distribution's `prometheus` package (about
# 19 MB to download; promtool and the server are 48 and 50 MB, both standalone) without installing
# the package, its service, user or dependencies. Elsewhere, install them from your distribution or
# from a Prometheus release and put them on PATH.
#
#   bash dashboards/install_promtool.sh                        # promtool into /usr/local/bin (root or sudo)
#   bash dashboards/install_promtool.sh promtool prometheus    # and the server
#   PROMTOOL_DIR=$HOME/.local/bin bash dashboards/install_promtool.sh
set -euo pipefail

DEST="${PROMTOOL_DIR:-/usr/local/bin}"
WANTED=("$@")
if [ ${#WANTED[@]} -eq 0 ]; then
    WANTED=(promtool)
fi

MISSING=()
for binary in "${WANTED[@]}"; do
    case "$binary" in
        promtool|prometheus) ;;
        *) echo "install_promtool.sh: unknown binary '$binary'; expected promtool or prometheus" >&2; exit 2 ;;
    esac
    if command -v "$binary" >/dev/null 2>&1; then
        echo "$binary already installed: $(command -v "$binary")"
    elif [ -x "$DEST/$binary" ]; then
        echo "$binary already installed: $DEST/$binary"
    else
        MISSING+=("$binary")
    fi
done
if [ ${#MISSING[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "install_promtool.sh: no apt-get/dpkg-deb here; install ${MISSING[*]} (Prometheus) yourself" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"  # apt's download sandbox user must be able to write here
cd "$tmp"

# `apt-get download` needs package lists; refresh them only when the first try finds none.
if ! apt-get download prometheus >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    apt-get download prometheus
fi
mkdir -p "$DEST" 2>/dev/null || $SUDO mkdir -p "$DEST"
for binary in "${MISSING[@]}"; do
    dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x "./usr/bin/$binary"
    if [ -w "$DEST" ]; then
        install -m 0755 "usr/bin/$binary" "$DEST/$binary"
    else
        $SUDO install -m 0755 "usr/bin/$binary" "$DEST/$binary"
    fi
    "$DEST/$binary" --version 2>&1 | head -n 1
done
case ":$PATH:" in
    *":$DEST:"*) ;;
    *) echo "note: $DEST is not on PATH; add it so the tests find ${MISSING[*]}" >&2 ;;
esac
