#!/usr/bin/env python3
"""Writes kubernetes.binpb: the protobuf descriptors of Kubernetes' built-in types,
as a FileDescriptorSet, taken from a kubectl binary.

Go programs built with gogo-protobuf (kubectl up to 1.32) register each
`generated.proto` as a gzipped FileDescriptorProto. Those descriptors are the
ones kubectl encodes with, and, unlike the `.proto` files published upstream,
they keep the `(gogoproto.nullable) = false` field option (extension 65001) that
tells a Go value field from a pointer field: the decoder needs it to tell an
unset field from an explicit zero.

Usage: extract_descriptors.py [path/to/kubectl] > kubernetes.binpb
Only the Python standard library is used.
"""

import re
import sys
import zlib

GOGO = b"github.com/gogo/protobuf/gogoproto/gogo.proto"
# The packages the API server serves kinds from; k8s.io/metrics is left out.
PREFIXES = (b"k8s.io/api/", b"k8s.io/apimachinery/")


def varint(data, i):
    """Decodes the varint at data[i:]; returns (value, next index)."""
    shift = result = 0
    while True:
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def encode_varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fields(data):
    """Yields (field number, wire type, raw field bytes, payload) of a message."""
    i = 0
    while i < len(data):
        start = i
        key, i = varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = varint(data, i)
            payload = None
        elif wire == 1:
            i += 8
            payload = None
        elif wire == 2:
            n, i = varint(data, i)
            payload = data[i : i + n]
            i += n
        elif wire == 5:
            i += 4
            payload = None
        else:
            raise ValueError(f"unexpected wire type {wire}")
        yield number, wire, data[start:i], payload


def descriptors(binary):
    """The FileDescriptorProtos gzipped inside a Go binary, by file name."""
    found = {}
    for m in re.finditer(rb"\x1f\x8b\x08\x00\x00\x00\x00\x00", binary):
        try:
            raw = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(
                binary[m.start() : m.start() + (4 << 20)]
            )
            name = next(p for n, w, _, p in fields(raw) if n == 1 and w == 2)
        except (zlib.error, ValueError, IndexError, StopIteration):
            continue
        if name.startswith(PREFIXES) and name.endswith(b"/generated.proto"):
            found[name] = raw
    return found


def without_gogo_import(file):
    """The file with its import of gogo.proto dropped (its options stay, as
    unknown extensions), so that the set is complete without gogo.proto."""
    out = bytearray()
    for number, _, raw, payload in fields(file):
        if number == 3 and payload == GOGO:  # FileDescriptorProto.dependency
            continue
        if number in (10, 11):  # public_dependency, weak_dependency: none expected
            raise ValueError("public or weak dependencies are not handled")
        out += raw
    return bytes(out)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/usr/bin/kubectl"
    with open(path, "rb") as f:
        found = descriptors(f.read())
    if b"k8s.io/api/core/v1/generated.proto" not in found:
        sys.exit(f"{path}: no Kubernetes descriptors found (gogo-protobuf builds only)")
    out = bytearray()
    for name in sorted(found):
        file = without_gogo_import(found[name])
        out += b"\x0a" + encode_varint(len(file)) + file  # FileDescriptorSet.file
        print(name.decode(), file=sys.stderr)
    sys.stdout.buffer.write(out)


if __name__ == "__main__":
    main()
