# rota — the two commands a newcomer needs:
#   make demo   bring up the local cluster and show rota at work
#   make test   lint, type-check and run the whole test suite against real binaries
# Both install what they need (a virtualenv in .venv, Kubernetes binaries built into a
# cache outside the repository) and can be run on a fresh machine.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all demo test lint typecheck unit proto proto-check k8s chart-tools registry-tools kwok manifests images host venv clean help release push verify signing-tools chart-readme scale

all: test

help:
	@echo "make demo       bring up the local cluster, rota, two simulated engines; show a switch"
	@echo "make test       ruff, mypy --strict and the whole pytest suite (builds what it needs)"
	@echo "make k8s        build or find the cached Kubernetes and containerd binaries"
	@echo "make images     build or find the cached images (pause, rota, engine simulator)"
	@echo "make host       install the Debian packages a real node needs (runc, CNI, socat...)"
	@echo "make chart-tools build or find the cached helm and promtool"
	@echo "make scale      rota's API load at 20 kwok GPU nodes, idle and switching (not part of"
	@echo "                make test; SCALE_ARGS='--nodes 100' etc., see python -m e2e.scale -h)"
	@echo "make manifests  render manifests/*.yaml from the Helm chart (charts/rota)"
	@echo "make proto      regenerate rota/pb from proto/"
	@echo "make chart-readme  write charts/rota/README.md from values.yaml and its schema"
	@echo "make release    wheel, sdist, krew plugin, image, chart, SBOMs, provenance and"
	@echo "                SHA256SUMS into dist/: a snapshot of any commit, or VERSION=x.y.z"
	@echo "                from a clean tree tagged vx.y.z (IMAGE=0: no image)"
	@echo "make push REGISTRY=host/path SIGNING_KEY=cosign.key  dist/'s image and chart to a"
	@echo "                registry, cosign-signed, provenance attested (PLAIN_HTTP=1: no TLS)"
	@echo "make verify REGISTRY=host/path VERSION=v PUBLIC_KEY=cosign.pub  check them there"
	@echo "make signing-tools  build or find the cached cosign"

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "rota needs Python 3.11+"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,harness]'
	touch $@

venv: $(STAMP)

k8s:
	bash e2e/toolchain/build-k8s.sh

host:
	bash e2e/toolchain/setup-host.sh

images: $(STAMP)
	$(PY) -m e2e.images

chart-tools:
	bash e2e/toolchain/build-chart-tools.sh

registry-tools:
	bash e2e/toolchain/build-registry.sh

kwok:
	bash e2e/toolchain/build-kwok.sh

# The scale harness (docs/scale.md): minutes of two cores at 20 nodes; not run by make test.
SCALE_ARGS ?= --nodes 20 --idle-s 60 --switch-s 60 --switches-per-gpu-hour 60
scale: $(STAMP)
	ROTA_K8S_BIN="$$(bash e2e/toolchain/build-k8s.sh | tail -n 1)" \
	ROTA_KWOK_BIN="$$(bash e2e/toolchain/build-kwok.sh | tail -n 1)" \
	$(PY) -m e2e.scale $(SCALE_ARGS)

manifests: $(STAMP)
	ROTA_CHART_TOOLS_BIN="$$(bash e2e/toolchain/build-chart-tools.sh | tail -n 1)" $(PY) -m e2e.release.chart render-manifests

chart-readme: $(STAMP)
	$(PY) -m e2e.release.chart_readme

# Without VERSION: a snapshot of the commit (or the release HEAD is tagged as); with it, a
# release, checked against pyproject.toml (the one source), CHANGELOG.md and the tag.
VERSION ?=
IMAGE   ?= 1
release: $(STAMP)
	ROTA_CHART_TOOLS_BIN="$$(bash e2e/toolchain/build-chart-tools.sh | tail -n 1)" \
	$(PY) -m e2e.release build --version "$(VERSION)" $(if $(filter 0,$(IMAGE)),--no-image,)

# dist/ to REGISTRY (host[:port]/path), signed with the cosign key file SIGNING_KEY (or
# UNSIGNED=1); make verify checks it there with PUBLIC_KEY. PLAIN_HTTP=1: no TLS.
REGISTRY    ?=
SIGNING_KEY ?=
PUBLIC_KEY  ?=
PLAIN_HTTP  ?= 0
UNSIGNED    ?= 0
DIST        ?= dist
PUBLISH_ENV = ROTA_CHART_TOOLS_BIN="$$(bash e2e/toolchain/build-chart-tools.sh | tail -n 1)" \
	ROTA_REGISTRY_TOOLS_BIN="$$(bash e2e/toolchain/build-registry.sh | tail -n 1)" \
	ROTA_COSIGN_BIN="$$(bash e2e/toolchain/build-cosign.sh | tail -n 1)"
push: $(STAMP)
	$(PUBLISH_ENV) $(PY) -m e2e.release push --registry "$(REGISTRY)" --key "$(SIGNING_KEY)" \
	--dist "$(DIST)" \
	$(if $(filter 1,$(PLAIN_HTTP)),--plain-http,) $(if $(filter 1,$(UNSIGNED)),--unsigned,)

verify: $(STAMP)
	ROTA_COSIGN_BIN="$$(bash e2e/toolchain/build-cosign.sh | tail -n 1)" \
	$(PY) -m e2e.release verify --registry "$(REGISTRY)" --public-key "$(PUBLIC_KEY)" \
	--version "$(VERSION)" --dist "$(DIST)" \
	$(if $(filter 1,$(PLAIN_HTTP)),--plain-http,) $(if $(filter 0,$(IMAGE)),--no-image,)

signing-tools:
	bash e2e/toolchain/build-cosign.sh

proto: $(STAMP)
	$(PY) -m proto.generate

proto-check: $(STAMP)
	$(PY) -m proto.generate --check

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy driver controller rota e2e tests proto

test: $(STAMP) host lint typecheck proto-check
	ROTA_K8S_BIN="$$(bash e2e/toolchain/build-k8s.sh | tail -n 1)" \
	ROTA_CHART_TOOLS_BIN="$$(bash e2e/toolchain/build-chart-tools.sh | tail -n 1)" \
	$(VENV)/bin/pytest $(PYTEST_ARGS)

unit: $(STAMP)
	$(VENV)/bin/pytest -m "not cluster" $(PYTEST_ARGS)

demo: $(STAMP) host
	ROTA_K8S_BIN="$$(bash e2e/toolchain/build-k8s.sh | tail -n 1)" $(PY) -m e2e.tools.demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .rota dist
