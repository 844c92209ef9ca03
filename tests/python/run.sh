#!/usr/bin/env bash
# End-to-end tests with the official Python client against `trellis server`.
# The binary is $TRELLIS_BIN (default: debug/trellis in $CARGO_TARGET_DIR, else in
# target/ under the repository root); build it first. Extra arguments go to pytest, e.g. `-k watch`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

requirements=tests/python/requirements.txt
# Skip pip when the pinned versions are already installed.
if ! python3 - "$requirements" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
for line in open(sys.argv[1]):
    name, _, pinned = line.strip().partition("==")
    if name and version(name) != pinned:
        sys.exit(1)
PY
    if ! python3 -m pip install -q -r "$requirements"; then
        # Distributions that mark their Python as externally managed (PEP 668).
        python3 -m pip install -q --break-system-packages -r "$requirements"
    fi
fi

# Where cargo put it: CARGO_TARGET_DIR when the caller set one.
export TRELLIS_BIN="${TRELLIS_BIN:-${CARGO_TARGET_DIR:-target}/debug/trellis}"
if [[ ! -x "$TRELLIS_BIN" ]]; then
    echo "tests/python: no trellis binary at $TRELLIS_BIN (run \`cargo build -p trellis\` first)" >&2
    exit 2
fi
export PYTHONDONTWRITEBYTECODE=1
exec python3 -m pytest -q -p no:cacheprovider tests/python "$@"
