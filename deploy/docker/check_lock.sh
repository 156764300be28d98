#!/usr/bin/env bash
# What the CPU image's build stage installs, reproduced in a throwaway venv without Docker:
# requirements.lock + torch (constraints/cpu.txt) + the project with --no-deps, then
# `pip check`, an import of every service, and weight-sync serving /healthz.
# Needs PyPI (and the CPU torch wheel); not part of `make test`.
#   bash deploy/docker/check_lock.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"; [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q -c constraints/cpu.txt -r deploy/docker/requirements.lock torch
"$venv/bin/pip" install -q --no-deps .
"$venv/bin/pip" check
(cd / && "$venv/bin/python" -c "
import importlib, torch
for m in ('quant_cache', 'weight_sync', 'rollout', 'trainer'):
    importlib.import_module(f'services.{m}.__main__')
print('torch', torch.__version__, '- every service imports')")
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
TRACE_AUTH_TOKEN=check TRACE_GRPC_PORT=0 TRACE_HTTP_PORT="$port" TRACE_HTTP_HOST=127.0.0.1 \
    "$venv/bin/trace-rl" serve weight-sync > /dev/null 2>&1 &
pid=$!
for _ in $(seq 60); do
    if curl -fsS "http://127.0.0.1:$port/healthz" 2>/dev/null; then echo; echo "lock OK"; exit 0; fi
    sleep 1
done
echo "weight-sync did not serve /healthz" >&2
exit 1
