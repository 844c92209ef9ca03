# The two commands of the README, and the steps they share.
#   make up    start Trellis on its embedded default
#   make test  run the whole test suite
# Both install what they need first (idempotent).

CARGO ?= cargo
DATA_DIR ?= $(HOME)/.local/share/trellis
# Runs as root on CI machines; elsewhere apt needs sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: deps test-deps plugins test-plugins up test lint bench-store bench-admission bench-plugin-reload

deps:
	@missing=""; \
	command -v etcd >/dev/null || missing="$$missing etcd-server"; \
	command -v protoc >/dev/null || missing="$$missing protobuf-compiler"; \
	command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	command -v prlimit >/dev/null || missing="$$missing util-linux"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi

# The WASM plugins: fixtures, examples (Rust, Python, JavaScript) into plugins/target/dist.
plugins:
	plugins/build.sh

up: deps plugins
	$(CARGO) run --release -p trellis -- up --data-dir $(DATA_DIR)

# kubectl 1.20 for the compatibility tests and docker-registry for the oci:// plugin
# tests: Debian's packages, unpacked under ~/.cache/trellis, never installed (the
# system's kubectl stays as it is).
test-deps: deps
	@tests/tools/kubectl-1.20.sh >/dev/null
	@tests/tools/docker-registry.sh >/dev/null

# The plugin SDK and the examples' own tests, natively (Rust, Python, JavaScript).
test-plugins: plugins
	$(CARGO) test -q --manifest-path plugins/Cargo.toml --workspace
	cd examples/plugins/require-team-label && python3 -m unittest -q
	cd examples/plugins/deny-latest-tag && node --test

test: test-deps plugins test-plugins
	$(CARGO) test --workspace
	$(CARGO) build -p trellis
	tests/python/run.sh

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# The figures in docs/benchmarks.md.
bench-store: deps
	.ci/bench-store

bench-admission: deps plugins
	.ci/bench-admission

# Time from a plugin change (Plugin object, new module, plugins directory) to the first
# request the new version judges.
bench-plugin-reload: plugins
	RUST_LOG=$${RUST_LOG:-warn} $(CARGO) run --release -q -p trellis -- bench plugin-reload --rounds 50 --json
