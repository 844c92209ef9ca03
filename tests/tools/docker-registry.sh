#!/bin/sh
# Unpacks Debian's docker-registry (the CNCF distribution registry) into a cache
# directory, without installing it, and prints the path of its binary. The plugin tests
# run it on a loopback port to pull oci:// modules from (TRELLIS_REGISTRY names another
# binary). Idempotent: an unpacked copy is reused.
#
#   tests/tools/docker-registry.sh [DIR]    (default: ~/.cache/trellis/docker-registry)
set -eu

dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/trellis/docker-registry}
bin=$dir/root/usr/bin/docker-registry

if [ -x "$bin" ] && "$bin" --version >/dev/null 2>&1; then
  echo "$bin"
  exit 0
fi

mkdir -p "$dir"
cd "$dir"
rm -f docker-registry_*.deb
version=$(apt-cache policy docker-registry | sed -n 's/^ *Candidate: *//p')
case "$version" in
  "" | "(none)") echo "no docker-registry package candidate (apt-get update?)" >&2; exit 1 ;;
esac
apt-get download -q "docker-registry=$version" >&2
rm -rf root
dpkg-deb -x docker-registry_*.deb root
"$bin" --version >&2
echo "$bin"
