# The two commands of the README: `make demo` (the main job) and `make test`. Both bootstrap everything.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
UV_VERSION := 0.13.9
STAMP := $(VENV)/.installed

.PHONY: install demo test test-unit lint lock clean-local

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
		echo "building the native span flattener ($(NATIVE), Rust) into consumers/ (fulmen.consumers._otlp_rows)..."; \
		cargo build -q --release --manifest-path $(NATIVE)/Cargo.toml && \
		cp $(NATIVE)/target/release/libfulmen_otlp_rows.so consumers/_otlp_rows.abi3.so; \
	else \
		echo "note: cargo not found, so the native span flattener is not built; spans use the Python path"; \
	fi
	@touch $(STAMP)

# The venv plus the Kafka jars (`fulmen kafka fetch`: Maven and Java), for what starts a broker.
install: $(STAMP)
	@$(VENV)/bin/fulmen kafka fetch >/dev/null

demo: install
	$(VENV)/bin/fulmen demo

test: install
	$(VENV)/bin/python -m pytest -q

# No broker in these two: the venv is all they need (no Java, no Maven).
test-unit: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Re-resolve the pinned dependency set (run after editing pyproject.toml's dependencies).
lock:
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --extra frameworks --python-version 3.11 -q -o requirements.lock

# Stop the local broker and forget local state (Kafka data, embedded store) under $FULMEN_HOME.
clean-local: install
	-$(VENV)/bin/fulmen kafka down
	rm -rf "$${FULMEN_HOME:-$$HOME/.local/share/fulmen}"
