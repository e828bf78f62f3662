# The two commands of the README: `make demo` (the main job) and `make test`. Both bootstrap everything.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
UV_VERSION := 0.13.9
STAMP := $(VENV)/.installed
# Playwright drives the system chromium (the browser tests): it must never fetch a browser build of its own.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1

.PHONY: prereqs install chromium demo test test-unit lint docs lock clean-local

NATIVE := native/otlp_rows
NATIVE_SOURCES := $(NATIVE)/Cargo.toml $(NATIVE)/pyproject.toml $(wildcard $(NATIVE)/src/*.rs)

# A virtualenv with the locked dependencies, Fulmen itself (editable), and the native span flattener when a
# Rust toolchain is there (without one, the pure-Python flattening does the same work, slower).
# Re-runs only when one of them changes.
$(STAMP): pyproject.toml requirements.lock $(NATIVE_SOURCES)
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install -q --python $(VENV)/bin/python -r requirements.lock
	$(VENV)/bin/uv pip install -q --python $(VENV)/bin/python --no-deps -e .
	@$(VENV)/bin/uv pip uninstall -q --python $(VENV)/bin/python fulmen-otlp-rows 2>/dev/null || true
	@if command -v cargo >/dev/null; then \
		echo "building the native span flattener ($(NATIVE), Rust) into infra/ (fulmen.infra._otlp_rows: the gateway splits with it, the spans consumer flattens)..."; \
		cargo build -q --release --manifest-path $(NATIVE)/Cargo.toml && \
		cp $(NATIVE)/target/release/libfulmen_otlp_rows.so infra/_otlp_rows.abi3.so.tmp && \
		mv -f infra/_otlp_rows.abi3.so.tmp infra/_otlp_rows.abi3.so; \
	else \
		echo "note: cargo not found, so the native span flattener is not built; spans use the Python path"; \
	fi
	@touch $(STAMP)

# The dashboard's chart library, uPlot, from the npm registry: the pinned tarball (its sha256 checked), of which
# the minified script, its stylesheet and its licence ship in the package (no page needs the internet).
UPLOT_VERSION := 1.6.32
UPLOT_SHA256 := 4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d
VENDOR := fulmen/dashboard/static/vendor
$(VENDOR)/uPlot.iife.min.js:
	@command -v npm >/dev/null || { echo "npm (Node.js) is needed once, to fetch the dashboard's chart library"; exit 1; }
	@echo "fetching uPlot $(UPLOT_VERSION) from npm into $(VENDOR)..."
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		(cd "$$tmp" && npm pack --silent uplot@$(UPLOT_VERSION) >/dev/null) && \
		echo "$(UPLOT_SHA256)  $$tmp/uplot-$(UPLOT_VERSION).tgz" | sha256sum -c --quiet && \
		tar -xzf "$$tmp/uplot-$(UPLOT_VERSION).tgz" -C "$$tmp" package/dist/uPlot.iife.min.js package/dist/uPlot.min.css package/LICENSE && \
		mkdir -p $(VENDOR) && cp "$$tmp/package/dist/uPlot.min.css" $(VENDOR)/ && \
		cp "$$tmp/package/LICENSE" $(VENDOR)/uPlot.LICENSE && cp "$$tmp/package/dist/uPlot.iife.min.js" $(VENDOR)/

# The browser tests (marker `browser`) drive Debian's Chromium: installed once, when it is missing.
chromium:
	@test -x /usr/bin/chromium || { echo "installing Debian's chromium (browser tests)..."; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# llama.cpp's server for the llamacpp backend (FULMEN_LLM_BACKEND=llamacpp), built from the sources in the
# llama-cpp-python sdist for this CPU into ~/.cache/fulmen/llama.cpp (about 6 minutes on 2 cores, once; the module
# does nothing when that build is there). Without cmake or a C++ compiler it prints a note and install goes on
# (the stamp stays unset, so the next install tries again); the backend then says how to build it.
LLAMACPP_BUILD := producers/llm_gateway/backends/llamacpp_build.py
LLAMACPP_STAMP := $(VENV)/.llamacpp-built
$(LLAMACPP_STAMP): $(STAMP) $(LLAMACPP_BUILD)
	@$(VENV)/bin/python -m fulmen.producers.llm_gateway.backends.llamacpp_build && touch $(LLAMACPP_STAMP) || true

# SeaweedFS's `weed`, the S3 server the object-store tests run against (marker `cluster`), built with Go from its
# module into ~/.cache/fulmen/seaweedfs (about 6 minutes on 2 cores, once). Without Go it prints why and the tests
# that need it skip, saying so.
WEED_STAMP := $(VENV)/.seaweedfs-built
$(WEED_STAMP): $(STAMP) fulmen/testing/seaweedfs.py fulmen/testing/gobuild.py
	@$(VENV)/bin/python -m fulmen.testing.seaweedfs && touch $(WEED_STAMP) || true

# Prometheus, the server the metrics test scrapes the stack with (marker `metrics`), built the same way into
# ~/.cache/fulmen/prometheus (minutes, once; without cloud service discovery). Without Go the test skips, saying so.
PROMETHEUS_STAMP := $(VENV)/.prometheus-built
$(PROMETHEUS_STAMP): $(STAMP) fulmen/testing/prometheus.py fulmen/testing/gobuild.py
	@$(VENV)/bin/python -m fulmen.testing.prometheus && touch $(PROMETHEUS_STAMP) || true

# What the machine must have, checked before anything is downloaded: each missing tool named, with what needs it.
prereqs:
	@missing=""; \
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || test -x $(VENV)/bin/python || \
		missing="$$missing\n  Python 3.11 as '$(PYTHON)' (or: make PYTHON=python3.11 ...): the virtualenv"; \
	command -v java >/dev/null || missing="$$missing\n  Java 17 (java): the local Kafka broker runs on it"; \
	command -v mvn >/dev/null || missing="$$missing\n  Maven (mvn): fetches the Kafka jars from Maven Central"; \
	test -f $(VENDOR)/uPlot.iife.min.js || command -v npm >/dev/null || \
		missing="$$missing\n  npm (Node.js): fetches the dashboard's chart library, once"; \
	test -x /usr/bin/chromium || command -v apt-get >/dev/null || \
		missing="$$missing\n  Chromium at /usr/bin/chromium, or Debian's apt-get (as root) to install it: the browser tests"; \
	if [ -n "$$missing" ]; then printf "make install needs:$$missing\n" >&2; exit 1; fi; \
	{ command -v cmake >/dev/null && command -v c++ >/dev/null; } || echo "note: without cmake and a C++ compiler, \
	llama.cpp's server (FULMEN_LLM_BACKEND=llamacpp) is not built; everything else works"
	@command -v go >/dev/null || echo "note: without Go, SeaweedFS (the S3 server of the object-store tests) is not \
	built and those tests skip"

# The venv plus the Kafka jars (`fulmen kafka fetch`: Maven and Java), for what starts a broker, the dashboard's
# chart library, the browser the dashboard's tests drive and llama.cpp's server.
install: prereqs $(STAMP) $(VENDOR)/uPlot.iife.min.js chromium $(LLAMACPP_STAMP)
	@$(VENV)/bin/fulmen kafka fetch >/dev/null

demo: install
	$(VENV)/bin/fulmen demo

# The docs site first (a few seconds; a broken link or a missing page fails it), then the suite on TEST_WORKERS
# workers (pytest-xdist; each takes a whole test file at a time, so a file's fixtures stay in one process, in
# collection order: tests/e2e, the longest files, first).
TEST_WORKERS ?= 2
test: install docs $(WEED_STAMP) $(PROMETHEUS_STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# No broker in these two: the venv is all they need (no Java, no Maven).
test-unit: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests/unit

# The docs site (mkdocs + material) into site/, git-ignored; the Reference pages are generated by docs/hooks.py.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Re-resolve the pinned dependency set (run after editing pyproject.toml's dependencies).
lock:
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --extra frameworks --python-version 3.11 -q -o requirements.lock

# Stop the local broker and forget local state (Kafka data, embedded store) under $FULMEN_HOME.
clean-local: install
	-$(VENV)/bin/fulmen kafka down
	rm -rf "$${FULMEN_HOME:-$$HOME/.local/share/fulmen}"
