# Two commands do all set-up on a fresh machine with Python >= 3.10:
#   make demo   # creates .venv if missing, installs the project, runs the MNIST ladder (single, then DDP x2)
#   make test   # creates .venv if missing, installs the project, runs the test suite
# DATA_DIR=path/with/MNIST/raw uses a local copy of MNIST instead of downloading it into ./data.

PYTHON ?= python3
VENV ?= .venv
DATA_DIR ?= data
BIN := $(VENV)/bin

.PHONY: demo test benchmark

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python benchmarks/mnist_speed.py --data-dir $(DATA_DIR) --runs single ddp

test: $(VENV)/.installed
	$(BIN)/python -m pytest

benchmark: $(VENV)/.installed
	$(BIN)/python benchmarks/mnist_speed.py --data-dir $(DATA_DIR) --plot images/mnist_speed_cpu.png
