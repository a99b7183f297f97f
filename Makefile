# Two commands do all set-up on a fresh machine with Python >= 3.10:
#   make demo   # creates .venv if missing, installs the project, runs the MNIST ladder (single, then DDP x2)
#   make test   # creates .venv if missing, installs the project, runs the test suite
#   make figures  # redraws every figure in docs/images/ from the code and from real runs (figures/, a few minutes)
#   make gpu-check  # on a machine with a GPU: tests/test_gpu.py and the GPU benchmark rows into docs/gpu_results.md
#   make docs       # builds the site into site/ with MkDocs (--strict); make docs-serve to read it on localhost:8000
#   make docs-outputs  # reruns every command the pages quote and records what it printed into the pages (slow)
# DATA_DIR=path/with/MNIST/raw uses a local copy of MNIST instead of downloading it into ./data.

PYTHON ?= python3
VENV ?= .venv
DATA_DIR ?= data
BIN := $(VENV)/bin

.PHONY: demo test benchmark figures gpu-check docs docs-serve docs-outputs

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

# Without a GPU it says so in one sentence and exits 0. MNIST must be on this machine (DATA_DIR).
gpu-check: $(VENV)/.installed
	$(BIN)/python tools/gpu_check.py --data-dir $(DATA_DIR)

benchmark: $(VENV)/.installed
	$(BIN)/python benchmarks/mnist_speed.py --data-dir $(DATA_DIR) --plot docs/images/mnist_speed_cpu.png

# Schematics (SVG) are byte-stable: tests/test_figures.py redraws them and compares bytes.
FIGURES := ring_allreduce allreduce_algorithms bucket_assignment accumulation_syncs dp_vs_ddp zero_stages ddp_step_lanes resume_sequence hsdp_mesh overlap_timeline step_time_breakdown compile_breakdown

figures: $(VENV)/.installed
	for figure in $(FIGURES); do $(BIN)/python figures/$$figure.py || exit 1; done
	$(BIN)/python benchmarks/allreduce_speed.py --world-sizes 2 4 --plot docs/images/allreduce_busbw.png

docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

docs-serve: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

# Every page's outputs, on this machine (the pages name it); MNIST from DATA_DIR, as for the demo.
docs-outputs: $(VENV)/.installed
	$(BIN)/python tools/record_outputs.py --data-dir $(DATA_DIR)
