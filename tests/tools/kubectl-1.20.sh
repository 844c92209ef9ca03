#!/bin/sh
# Unpacks Debian's kubernetes-client (kubectl 1.20) into a cache directory, without
# installing it, and prints the path of its kubectl. The tests run it as a second,
# older client (TRELLIS_KUBECTL_1_20). Idempotent: an unpacked copy is reused.
#
#   tests/tools/kubectl-1.20.sh [DIR]    (default: ~/.cache/trellis/kubectl-1.20)
set -eu

dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/trellis/kubectl-1.20}
bin=$dir/root/usr/bin/kubectl

if [ -x "$bin" ] && "$bin" version --client --short 2>/dev/null | grep -q 'v1\.20\.'; then
  echo "$bin"
  exit 0
fi

mkdir -p "$dir"
cd "$dir"
rm -f kubernetes-client_*.deb
# The candidate must be a 1.20 build: Debian bookworm's is 1.20.5+really1.20.2.
version=$(apt-cache policy kubernetes-client | sed -n 's/^ *Candidate: *//p')
case "$version" in
  1.20.*) ;;
  *) echo "kubernetes-client candidate is '$version', not 1.20 (apt-get update?)" >&2; exit 1 ;;
esac
apt-get download -q "kubernetes-client=$version" >&2
rm -rf root
dpkg-deb -x kubernetes-client_*.deb root
"$bin" version --client --short >&2
echo "$bin"
