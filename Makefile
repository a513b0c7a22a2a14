# fedfields developer entry points: make install | demo | test | lint

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint

install: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch and torchvision are pinned and installed FIRST: on this machine pip takes torch 2.14.1
# and torchvision 0.29.1 from the wheels on disk (no multi-GB download in CI); torchvision is
# LPIPS's backbone, and PyPI's torchvision does not import beside the CPU-only torch 2.13
# wheel ("operator torchvision::nms does not exist"). Seeded results are bit-identical on both
# builds (tests/method_digests.json). Users elsewhere just `pip install -e .` and get torch from
# pyproject's range (>=2.4) with the torchvision that matches it.
# The stamp file makes repeated `make test` skip reinstalling until pyproject.toml changes.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -e ".[dev]"
	touch $@

# The default federated run: `flwr run .` with DecentNeRF on crowdsourced lego (16 users x 5
# views, 100x100) through Ray, ~6-16 minutes on 2 cores; the report lands in
# runs/<time>-<strategy>/. Each demo has its own Flower home and SuperLink ports, so demos
# run side by side (docs/SIMULATION.md, "Runs side by side").
# Extra run-config: make demo RUN_CONFIG="strategy='fedavg' num-server-rounds=3"
RUN_CONFIG ?=
demo: install
	$(BIN)/python -m simulations.launch --run-config "$(RUN_CONFIG)"

# report.html's browser test skips without chromium; CI (.ci/run) installs it and requires it.
test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
