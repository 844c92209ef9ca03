#!/usr/bin/env bash
# Builds every plugin into plugins/target/dist/NAME.wasm:
#   - the Rust workspace (plugins/controllers/*, the built-in controllers the host
#     also bundles; plugins/fixtures/*; examples/plugins/*, examples/controllers/*
#     and examples/scheduler/* with a Cargo.toml)
#     for wasm32-wasip2 in release, against today's contract (wit/core, wit/admission,
#     wit/initializer);
#   - the Rust examples again against the frozen first contract (wit/plugin/0.1.0,
#     the SDK's feature wit-plugin-0-1), into plugins/target/dist/plugin-0.1.0/, so
#     the host's tests load components as they were built before the split;
#   - Python examples (an app.py) with componentize-py, from a venv in
#     plugins/target/venv; Python controllers (examples/controllers/*/app.py)
#     against wit/controller, Python scheduler plugins (examples/scheduler/*/app.py)
#     against wit/scheduler, Python workloads (examples/workloads/*/app.py) against
#     the world in their own wit/ folder;
#   - JavaScript examples (a package.json) with `npm ci` and `npm run build`.
# The Python and JavaScript examples are built against wit/plugin/0.1.0.
# A plugin whose output is newer than all of its inputs is skipped, so a run with
# nothing to do takes well under a second. Installs what is missing (the Rust
# target, python3-venv, nodejs/npm) on a fresh Debian machine.
#
# Usage: plugins/build.sh [--force]
set -euo pipefail

COMPONENTIZE_PY_VERSION=0.25.1

plugins=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$plugins")
wit=$repo/wit
# What the Python and JavaScript examples are built against.
frozen_wit=$wit/plugin/0.1.0
examples=$repo/examples/plugins
dist=$plugins/target/dist
frozen_dist=$dist/plugin-0.1.0
venv=$plugins/target/venv
force=${1:-}
built=0

mkdir -p "$dist" "$frozen_dist"

say() { printf 'plugins: %s\n' "$*"; }

# True when $1 exists and nothing under the other arguments is newer (build
# outputs and installed packages do not count as inputs).
fresh() {
  local out=$1
  shift
  [ "$force" != --force ] && [ -e "$out" ] &&
    [ -z "$(find "$@" \( -name target -o -name node_modules -o -name __pycache__ \) -prune \
      -o -type f ! -name "*.md" ! -name plugin.yaml -newer "$out" -print -quit 2>/dev/null)" ]
}

apt_install() {
  local sudo=
  [ "$(id -u)" = 0 ] || sudo=sudo
  command -v apt-get >/dev/null || return 1
  say "installing Debian packages: $*"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

# --- Rust ------------------------------------------------------------------
rust_dirs=()
for manifest in "$plugins"/controllers/*/Cargo.toml "$plugins"/fixtures/*/Cargo.toml "$examples"/*/Cargo.toml "$repo"/examples/controllers/*/Cargo.toml "$repo"/examples/scheduler/*/Cargo.toml "$repo"/examples/workloads/*/Cargo.toml; do
  [ -e "$manifest" ] && rust_dirs+=("$(dirname "$manifest")")
done

# The host's crates the plugins build in (quantities, quota accounting), by path.
host_crates=("$repo/host/quantity" "$repo/host/quota")

rust_stale=()
for dir in "${rust_dirs[@]}"; do
  fresh "$dist/$(basename "$dir").wasm" "$dir" "$plugins/sdk" "${host_crates[@]}" "$wit" "$plugins/Cargo.toml" "$plugins/Cargo.lock" ||
    rust_stale+=("$(basename "$dir")")
done

if [ ${#rust_stale[@]} -gt 0 ]; then
  say "building ${rust_stale[*]} (Rust, wasm32-wasip2 release)"
  if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
  fi
  # Its own target directory whatever the caller set: the copies below read from it.
  CARGO_TARGET_DIR="$plugins/target" cargo build --quiet --release --target wasm32-wasip2 \
    --manifest-path "$plugins/Cargo.toml"
  for name in "${rust_stale[@]}"; do
    cp "$plugins/target/wasm32-wasip2/release/${name//-/_}.wasm" "$dist/$name.wasm"
    built=$((built + 1))
  done
fi

# The Rust examples against the frozen contract: a target directory of their own,
# so that the two builds do not undo each other's artifacts.
frozen_stale=()
for manifest in "$examples"/*/Cargo.toml; do
  [ -e "$manifest" ] || continue
  dir=$(dirname "$manifest")
  fresh "$frozen_dist/$(basename "$dir").wasm" "$dir" "$plugins/sdk" "${host_crates[@]}" "$wit" "$plugins/Cargo.toml" "$plugins/Cargo.lock" ||
    frozen_stale+=("$(basename "$dir")")
done

if [ ${#frozen_stale[@]} -gt 0 ]; then
  say "building ${frozen_stale[*]} (Rust, against trellis:plugin@0.1.0)"
  CARGO_TARGET_DIR="$plugins/target/plugin-0.1.0" cargo build --quiet --release --target wasm32-wasip2 \
    --manifest-path "$plugins/Cargo.toml" --features trellis-plugin/wit-plugin-0-1 \
    $(printf -- '-p %s ' "${frozen_stale[@]}")
  for name in "${frozen_stale[@]}"; do
    cp "$plugins/target/plugin-0.1.0/wasm32-wasip2/release/${name//-/_}.wasm" "$frozen_dist/$name.wasm"
    built=$((built + 1))
  done
fi

# --- Python ----------------------------------------------------------------
# A venv of our own keeps componentize-py at its pinned version. Debian ships
# `venv` without ensurepip unless python3-venv is installed; without either,
# fall back to a user install.
componentize_py() {
  if [ -x "$venv/bin/componentize-py" ] &&
    [ "$("$venv/bin/componentize-py" --version 2>/dev/null)" = "componentize-py $COMPONENTIZE_PY_VERSION" ]; then
    echo "$venv/bin/componentize-py"
    return
  fi
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"
    apt_install python3-venv >&2 || true
    python3 -m venv "$venv" >/dev/null 2>&1 || rm -rf "$venv"
  fi
  if [ -x "$venv/bin/pip" ]; then
    say "installing componentize-py $COMPONENTIZE_PY_VERSION into $venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION" >&2
    echo "$venv/bin/componentize-py"
    return
  fi
  say "no venv; installing componentize-py $COMPONENTIZE_PY_VERSION for this user" >&2
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip >&2
  # Debian marks its Python as externally managed; a --user install is ours to make.
  python3 -m pip install --quiet --user --break-system-packages "componentize-py==$COMPONENTIZE_PY_VERSION" >&2 ||
    python3 -m pip install --quiet --user "componentize-py==$COMPONENTIZE_PY_VERSION" >&2
  echo "$(python3 -m site --user-base)/bin/componentize-py"
}

for app in "$examples"/*/app.py; do
  [ -e "$app" ] || continue
  dir=$(dirname "$app")
  name=$(basename "$dir")
  out=$dist/$name.wasm
  fresh "$out" "$dir" "$frozen_wit" && continue
  # The world is named in the app's first lines: `# world: admission`.
  world=$(sed -n 's/^# world: *\([a-z-]*\).*/\1/p' "$app" | head -n 1)
  say "building $name (Python, componentize-py, world ${world:=admission})"
  cpy=$(componentize_py)
  (cd "$dir" && "$cpy" --wit-path "$frozen_wit" --world "$world" componentize app --output "$out.tmp" >/dev/null)
  mv "$out.tmp" "$out"
  built=$((built + 1))
done

# Python controllers (examples/controllers/*/app.py) and scheduler plugins
# (examples/scheduler/*/app.py), against today's worlds of those kinds: they have no
# frozen first version.
for kind in controller:controllers scheduler:scheduler; do
  world=${kind%%:*}
  world_wit=$wit/$world/0.1.0
  for app in "$repo"/examples/"${kind#*:}"/*/app.py; do
    [ -e "$app" ] || continue
    dir=$(dirname "$app")
    name=$(basename "$dir")
    out=$dist/$name.wasm
    fresh "$out" "$dir" "$world_wit" "$wit/core" && continue
    say "building $name (Python, componentize-py, world $world)"
    cpy=$(componentize_py)
    (cd "$dir" && "$cpy" --wit-path "$world_wit" --world "$world" componentize app --output "$out.tmp" >/dev/null)
    mv "$out.tmp" "$out"
    built=$((built + 1))
  done
done

# Python workloads (examples/workloads/*/app.py): programs for a node, against the
# one world in the example's own wit/ folder.
for app in "$repo"/examples/workloads/*/app.py; do
  [ -e "$app" ] || continue
  dir=$(dirname "$app")
  name=$(basename "$dir")
  out=$dist/$name.wasm
  # Its Python and WIT files: a changed deployment.yaml needs no new component.
  fresh "$out" "$dir"/*.py "$dir/wit" && continue
  say "building $name (Python workload, componentize-py)"
  cpy=$(componentize_py)
  (cd "$dir" && "$cpy" --wit-path wit componentize app --output "$out.tmp" >/dev/null)
  mv "$out.tmp" "$out"
  built=$((built + 1))
done

# --- JavaScript ------------------------------------------------------------
for package in "$examples"/*/package.json; do
  [ -e "$package" ] || continue
  dir=$(dirname "$package")
  name=$(basename "$dir")
  out=$dist/$name.wasm
  fresh "$out" "$dir" "$frozen_wit" && continue
  say "building $name (JavaScript, componentize-js)"
  command -v npm >/dev/null || apt_install nodejs npm
  if ! fresh "$dir/node_modules/.package-lock.json" "$dir/package-lock.json" "$dir/package.json"; then
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
  fi
  (cd "$dir" && npm run --silent build)
  [ -e "$out" ] || { say "npm run build in $dir did not write $out" >&2; exit 1; }
  touch "$out"
  built=$((built + 1))
done

if [ "$built" = 0 ]; then
  say "all up to date in $dist"
else
  say "built $built into $dist"
fi
