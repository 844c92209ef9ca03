#!/bin/sh
# Installs Debian's containerd and runc, and the CNI plugins (bridge, host-local,
# portmap, with iptables) its CRI plugin gives pods a network with, as Trellis' runtime
# does (the containerd tests start a containerd of their own, under a temporary
# directory, whose CNI bin_dir is /usr/lib/cni and conf_dir holds the tests'
# conflist), and builds a busybox OCI image for it; prints the
# path of the image's tarball (an OCI image layout), or, on a machine that cannot run
# containerd, one line starting with "unsupported:" that says why.
#
# The tarball holds two images over one layer (Debian's busybox-static and its applet
# links): trellis.test/busybox:local (`sh`, as busybox images are) and
# trellis.test/pause:local (sleeps, to serve as containerd's sandbox image). Import it
# with `ctr -a SOCKET -n k8s.io images import --base-name trellis.test FILE`.
# Deterministic: no timestamps, so the same busybox-static gives the same digests.
# Idempotent: an installed containerd and a built tarball are reused.
#
#   tests/tools/containerd.sh [DIR]    (default: ~/.cache/trellis/containerd)
set -eu

dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/trellis/containerd}
image=$dir/busybox-oci.tar

# containerd runs containers as root only (it mounts overlayfs, runc makes cgroups).
if [ "$(id -u)" != 0 ]; then
  echo "unsupported: containerd needs root, and this is $(id -un)"
  echo "containerd needs root: the containerd test will be skipped" >&2
  exit 0
fi

missing=""
{ command -v containerd && command -v ctr; } >/dev/null || missing="$missing containerd"
command -v runc >/dev/null || missing="$missing runc"
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/portmap ] ||
  missing="$missing containernetworking-plugins"
command -v iptables >/dev/null || missing="$missing iptables"
if [ -n "$missing" ]; then
  echo "installing Debian packages:$missing" >&2
  apt-get update -qq
  # No recommends: nothing else is used.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

if [ -s "$image" ]; then
  echo "$image"
  exit 0
fi

umask 022
mkdir -p "$dir"
work=$(mktemp -d "$dir/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"

# busybox-static is unpacked, not installed: it conflicts with Debian's busybox.
version=$(apt-cache policy busybox-static | sed -n 's/^ *Candidate: *//p')
case "$version" in
  "" | "(none)") echo "no busybox-static package candidate (apt-get update?)" >&2; exit 1 ;;
esac
apt-get download -q "busybox-static=$version" >&2
dpkg-deb -x busybox-static_*.deb deb

mkdir -p rootfs/bin rootfs/dev rootfs/etc rootfs/proc rootfs/root rootfs/sys rootfs/tmp
chmod 1777 rootfs/tmp
cp deb/bin/busybox rootfs/bin/busybox
for applet in $(rootfs/bin/busybox --list-full); do
  [ -e "rootfs/$applet" ] || [ -L "rootfs/$applet" ] && continue
  mkdir -p "rootfs/$(dirname "$applet")"
  ln -s /bin/busybox "rootfs/$applet"
done

# Every entry owned by root, dated 1970, in name order: stable bytes.
pack() {
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=gnu "$@"
}

mkdir -p layout/blobs/sha256
# Stores stdin as a blob; prints "DIGEST SIZE".
blob() {
  cat >blob.tmp
  digest=$(sha256sum blob.tmp | cut -d' ' -f1)
  size=$(stat -c %s blob.tmp)
  mv blob.tmp "layout/blobs/sha256/$digest"
  echo "sha256:$digest $size"
}

# Uncompressed, so the layer's digest is also its diff ID.
set -- $(pack -C rootfs -cf - . | blob)
layer_digest=$1 layer_size=$2

arch=$(dpkg --print-architecture)
path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# The manifest of an image that runs CMD (a JSON array); prints "DIGEST SIZE".
manifest() {
  set -- $(printf '{"architecture":"%s","os":"linux","config":{"Env":["PATH=%s"],"Cmd":%s},"rootfs":{"type":"layers","diff_ids":["%s"]}}' \
    "$arch" "$path" "$1" "$layer_digest" | blob)
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
    "$1" "$2" "$layer_digest" "$layer_size" | blob
}
# An entry of the index: the manifest "DIGEST SIZE" ($1 $2) named $3.
entry() {
  printf '{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"org.opencontainers.image.ref.name":"%s","org.opencontainers.image.version":"busybox-static %s"}}' \
    "$1" "$2" "$arch" "$3" "$version"
}

busybox=$(entry $(manifest '["sh"]') trellis.test/busybox:local)
pause=$(entry $(manifest '["/bin/busybox","sleep","2147483647"]') trellis.test/pause:local)
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[%s,%s]}' \
  "$busybox" "$pause" >layout/index.json
printf '{"imageLayoutVersion":"1.0.0"}' >layout/oci-layout

pack -C layout -cf image.tar oci-layout index.json blobs
mv image.tar "$image"
echo "built $image (busybox-static $version)" >&2
echo "$image"
