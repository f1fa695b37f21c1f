# deltaflow: every target sets itself up on a fresh machine (virtualenv, packages, Delta jars).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export DELTAFLOW_JARS_DIR ?= $(HOME)/.cache/deltaflow/jars

# The demo's packages (deltaflow with Spark and delta-rs), then the developer's on top.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
# setuptools warns at every editable install that a folder named like the package may shadow
# it; here that folder is the package.
PIP_QUIET := PYTHONWARNINGS='ignore:Editable installation'
# A second environment with only `deltaflow[connect]` (pyspark-client, no JVM): the Spark
# Connect tests run a node from it.
CONNECT_VENV  ?= .venv-connect
CONNECT_STAMP := $(CONNECT_VENV)/.installed

.PHONY: setup dev-setup test-setup demo demo-cdc test fuzz bench bench-transport bench-layout mutation breaks lint docs clean versitygw toxiproxy

$(DEMO_STAMP): pyproject.toml
	@echo "==> virtualenv $(VENV) with deltaflow[spark,deltars] (pip: about a minute the first time)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP_QUIET) $(PY) -m pip install --quiet --progress-bar off -e '.[spark,deltars]'
	touch $@

$(STAMP): $(DEMO_STAMP)
	@echo "==> deltaflow[dev] into $(VENV): the test, lint and benchmark tools (pip, once)"
	$(PIP_QUIET) $(PY) -m pip install --quiet --progress-bar off -e '.[dev]'
	touch $@

# A real S3-compatible server for the object-storage tests: versitygw, pinned, built by Go
# (about 1.5 minutes once; docs/object-storage.md says why this one).
VERSITYGW_VERSION := v1.8.0
VERSITYGW := .tools/versitygw-$(VERSITYGW_VERSION)/versitygw

$(VERSITYGW):
	@echo "==> versitygw $(VERSITYGW_VERSION), the tests' S3 server (go install: about 1.5 minutes once)"
	GOBIN=$(CURDIR)/$(dir $@) go install github.com/versity/versitygw/cmd/versitygw@$(VERSITYGW_VERSION)

versitygw: $(VERSITYGW)

# A latency proxy for `bench/ingest.py --store-latency MS` (a store as far away as a cloud
# one): Toxiproxy, pinned, built by Go (about 10 s once); not needed by the tests.
TOXIPROXY_VERSION := v2.12.0
TOXIPROXY := .tools/toxiproxy-$(TOXIPROXY_VERSION)/toxiproxy-server

$(TOXIPROXY):
	GOBIN=$(CURDIR)/$(dir $@) go install github.com/Shopify/toxiproxy/v2/cmd/server@$(TOXIPROXY_VERSION)
	mv $(dir $@)server $@

toxiproxy: $(TOXIPROXY)

$(CONNECT_STAMP): pyproject.toml
	@echo "==> virtualenv $(CONNECT_VENV) with deltaflow[connect] alone (the Spark Connect tests' node)"
	$(PYTHON) -m venv $(CONNECT_VENV)
	$(CONNECT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PIP_QUIET) $(CONNECT_VENV)/bin/python -m pip install --quiet -e '.[connect]'
	touch $@

# Debian's chromium, for the status page's browser tests (Playwright drives it; no download).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

$(CHROMIUM):
	@echo "==> Debian's chromium, for the status page tests (apt: about a minute once)"
	$(SUDO) apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y --no-install-recommends chromium)

# systemd-analyze, which verifies deploy/deltaflow.service in the tests.
SYSTEMD_ANALYZE := /usr/bin/systemd-analyze

$(SYSTEMD_ANALYZE):
	@echo "==> Debian's systemd tools, to verify the unit file (apt, once)"
	$(SUDO) apt-get install -y --no-install-recommends systemd >/dev/null 2>&1 || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y --no-install-recommends systemd)

# What the demo needs: the virtualenv with deltaflow's Spark and delta-rs engines, and
# Delta's jars.
setup: $(DEMO_STAMP)
	@echo "==> Delta's jars into $(DELTAFLOW_JARS_DIR) (Maven Central, once)"
	$(VENV)/bin/deltaflow jars >/dev/null
	@echo "==> set up"

# What development needs besides: pytest, ruff, mypy, the benchmarks' libraries.
dev-setup: setup $(STAMP)

# What the tests need besides: the Connect environment, S3A's jars (about 690 MB, once), the
# S3 server, the browser and systemd-analyze.
test-setup: dev-setup $(CONNECT_STAMP) $(VERSITYGW) $(CHROMIUM) $(SYSTEMD_ANALYZE)
	@echo "==> S3A's jars and deltaflow's S3 log store (about 690 MB from Maven Central, once)"
	$(VENV)/bin/deltaflow jars --object-store >/dev/null

# `make demo DEMO_ARGS="--keep"` keeps the table; `--warehouse DIR` puts it there.
DEMO_ARGS ?=
demo: setup
	$(PY) -m deltaflow.cli demo $(DEMO_ARGS)

# examples/cdc_debezium.py on its sample events, out of order: the table ends at the source's rows.
demo-cdc: setup
	$(PY) examples/cdc_debezium.py examples/data/customers.jsonl --local \
		--expect examples/data/customers.expected.json

test: test-setup
	@echo "==> the test suite (about 20 minutes on 2 cores)"
	$(PY) -m pytest

bench: test-setup $(TOXIPROXY)
	$(PY) bench/ingest.py

bench-transport: test-setup
	$(PY) bench/transport.py

bench-layout: dev-setup
	$(PY) bench/layout.py

# The fuzzing net of the wire protocol with many more examples than `make test` runs:
# hypothesis over the decoders, the Arrow page reader and a live node's WebSocket. About 6 min.
fuzz: dev-setup
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest tests/test_fuzz.py tests/test_arrow_bounds.py \
		-p no:cacheprovider --timeout=1200

# Mutation testing of the modules that carry the guarantees, against their fast unit tests
# (docs/mutation.md). Not part of `make test`; about 10 minutes on 2 cores.
mutation: test-setup
	$(PY) tools/mutation.py

# Whole mechanisms broken on purpose (ack before commit, arrival order, ...), each against the
# guarantee tests that must catch it (docs/mutation.md). A few minutes; not part of `make test`.
breaks: test-setup
	$(PY) tools/breaks.py

lint: dev-setup
	$(VENV)/bin/ruff check deltaflow tests examples bench tools
	$(VENV)/bin/ruff format --check deltaflow tests examples bench tools
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml): README.md as its home page, docs/, bench/README.md and
# the API reference from the docstrings, built strictly (a broken link or reference fails).
docs: dev-setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	@echo "==> the site is in $(CURDIR)/site (open site/index.html)"

clean:
	rm -rf $(VENV) $(CONNECT_VENV) .tools .pytest_cache .mypy_cache .ruff_cache mutants site
