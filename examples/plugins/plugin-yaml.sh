#!/usr/bin/env bash
# Prints an example's Plugin object (NAME/plugin.yaml) with its module's location
# and digest filled in from plugins/target/dist, ready for `kubectl apply -f -`:
#
#   examples/plugins/plugin-yaml.sh pod-policy | kubectl apply -f -
#
# Run plugins/build.sh first.
set -euo pipefail
name=${1:?usage: plugin-yaml.sh NAME}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dist=$(cd "$here/../../plugins/target/dist" 2>/dev/null && pwd) ||
  { echo "no plugins/target/dist; run plugins/build.sh" >&2; exit 1; }
wasm=$dist/$name.wasm
[ -e "$wasm" ] || { echo "no $wasm; run plugins/build.sh" >&2; exit 1; }
digest=$(sha256sum "$wasm" | cut -d' ' -f1)
sed -e "s|@DIST@|$dist|g" -e "s|@SHA256@|$digest|g" "$here/$name/plugin.yaml"
