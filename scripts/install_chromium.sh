#!/usr/bin/env bash
# Installs Chromium, which the tests of the HTML report open headless (tests/browser.py): the
# distribution's package on Debian/Ubuntu (apt-get; root or sudo). A Chromium or Chrome already on
# PATH is left alone. Elsewhere, install Chromium or Chrome from your distribution and put it on
# PATH as chromium, chromium-browser or google-chrome.
#
#   bash scripts/install_chromium.sh
set -euo pipefail

for name in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "chromium already installed: $(command -v "$name")"
        exit 0
    fi
done
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium.sh: no apt-get here; install Chromium or Chrome yourself and put it on PATH" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
# The package lists are refreshed only when the first try finds no candidate.
if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
chromium --version
