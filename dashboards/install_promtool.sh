#!/usr/bin/env bash
# Installs promtool, which tests/dashboards uses to validate prometheus.yml, the rules and every
# PromQL query of the dashboards. Does nothing when promtool is already on PATH.
#
# On Debian/Ubuntu it takes the promtool binary out of the distribution's `prometheus` package
# (about 19 MB to download, 48 MB installed) without installing the Prometheus server, its
# service, user or dependencies. Elsewhere, install promtool from your distribution or from a
# Prometheus release and put it on PATH.
#
#   bash dashboards/install_promtool.sh            # into /usr/local/bin (root or sudo)
#   PROMTOOL_DIR=$HOME/.local/bin bash dashboards/install_promtool.sh
set -euo pipefail

DEST="${PROMTOOL_DIR:-/usr/local/bin}"

if command -v promtool >/dev/null 2>&1; then
    echo "promtool already installed: $(command -v promtool)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "install_promtool.sh: no apt-get/dpkg-deb here; install promtool (Prometheus) yourself" >&2
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
dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool
mkdir -p "$DEST" 2>/dev/null || $SUDO mkdir -p "$DEST"
if [ -w "$DEST" ]; then
    install -m 0755 usr/bin/promtool "$DEST/promtool"
else
    $SUDO install -m 0755 usr/bin/promtool "$DEST/promtool"
fi
"$DEST/promtool" --version 2>&1 | head -n 1
case ":$PATH:" in
    *":$DEST:"*) ;;
    *) echo "note: $DEST is not on PATH; add it so the tests find promtool" >&2 ;;
esac
