#!/usr/bin/env python3
"""Writes openapi_v2.binpb: the descriptors of gnostic's OpenAPI v2 `Document`
(package openapi.v2, the message kubectl decodes `/openapi/v2` into when it asks
for `application/com.github.proto-openapi.spec.v2@v1.0+protobuf`), as a
FileDescriptorSet with its one dependency, google/protobuf/any.proto.

kubectl is built with protobuf-go, which registers each file as its raw
FileDescriptorProto (not gzipped). The file is found by its name and read field
by field up to `syntax` (field 12), which protoc-gen-go writes last.

Usage: extract_openapi_v2.py [path/to/kubectl] > openapi_v2.binpb
Needs protoc (for any.proto) and the Python standard library.
"""

import subprocess
import sys

from extract_descriptors import encode_varint, varint

NAME = b"openapiv2/OpenAPIv2.proto"


def raw_descriptor(binary):
    """The serialized FileDescriptorProto named NAME inside a Go binary."""
    start = binary.find(b"\x0a" + encode_varint(len(NAME)) + NAME + b"\x12")
    if start < 0:
        raise SystemExit(f"{NAME.decode()} not found")
    i = start
    while True:
        key, i = varint(binary, i)
        number, wire = key >> 3, key & 7
        if wire != 2 or not 1 <= number <= 14:
            raise SystemExit(f"unexpected field {number} (wire type {wire})")
        n, i = varint(binary, i)
        i += n
        if number == 12:  # syntax
            return binary[start:i]


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/usr/bin/kubectl"
    with open(path, "rb") as f:
        file = raw_descriptor(f.read())
    # A FileDescriptorSet holding any.proto, from protoc's own include directory.
    any_set = subprocess.run(
        ["protoc", "--include_imports", "--descriptor_set_out=/dev/stdout",
         "google/protobuf/any.proto"],
        check=True, capture_output=True,
    ).stdout
    sys.stdout.buffer.write(any_set + b"\x0a" + encode_varint(len(file)) + file)


if __name__ == "__main__":
    main()
