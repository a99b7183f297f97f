# Two commands do all set-up on a fresh machine with Python >= 3.11:
#   make demo   # creates .venv if missing, installs the project, runs the MNIST ladder (single, then DDP x2)
#   make test   # creates .venv if missing, installs the project (and builds DeepSpeed's CPU collectives), runs the test suite
#   make test-durations  # the same, then the suite's time per chapter, file and test into docs/tests.md
#   make test-lowest  # the suite against the lowest versions pyproject.toml allows, in a venv of its own (.venv-lowest)
#   make check  # a contributor's check before each commit, under a minute: lint, the lesson diffs, the layout,
#               # the site (--strict) with its recordings' staleness, and the fast unit equalities
#   make figures  # redraws every figure in images/ from the code and from real runs (figures/, a few minutes)
#   make gpu-check  # on a machine with a GPU: tests/test_gpu.py and the GPU benchmark rows into docs/gpu_results.md
#   make gpu-check-offline  # the same on a GPU machine with no package index: its own python3, no venv (make gpu-wheels first, here)
#   make docs       # builds the site into site/ with MkDocs (--strict); make docs-serve to read it on localhost:8000
#   make docs-outputs  # reruns every command the pages quote and records what it printed into the pages (slow)
# DATA_DIR=path/with/MNIST/raw uses a local copy of MNIST instead of downloading it into ./data.

PYTHON ?= python3
VENV ?= .venv
DATA_DIR ?= data
BIN := $(VENV)/bin

.PHONY: demo test test-durations test-lowest check benchmark figures gpu-check docs docs-serve docs-outputs

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# DeepSpeed compiles its shared-memory collectives for the CPU (deepspeed.comm.torch.build_shm_op) into
# ~/.cache/torch_extensions the first time a process needs them, half a minute or more of one core, again for each
# new environment. The suite has it built first, as its processes see the machine (no GPU), rather than in whichever
# test runs DeepSpeed first while the tests beside it wait for the build. Nothing to build without DeepSpeed.
prebuild_deepspeed = CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu $(1)/python -c "import importlib, importlib.util; \
	importlib.util.find_spec('deepspeed') and importlib.import_module('deepspeed.comm.torch').build_shm_op()" > /dev/null

$(VENV)/.deepspeed-built: $(VENV)/.installed
	$(call prebuild_deepspeed,$(BIN))
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python benchmarks/mnist_speed.py --data-dir $(DATA_DIR) --runs single ddp

test: $(VENV)/.deepspeed-built
	$(BIN)/python -m pytest

# The suite as make test runs it, then its time per chapter, per file and per test into docs/tests.md.
test-durations: $(VENV)/.deepspeed-built
	$(BIN)/python tools/durations.py --run

# Every lower bound pyproject.toml declares, tested, Python's included: tools/lowest_versions.py pins each to its bound.
LOWEST ?= .venv-lowest
LOWEST_PYTHON ?= python3.11

test-lowest:
	$(LOWEST_PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST)/bin/python tools/lowest_versions.py > $(LOWEST)/constraints.txt
	$(LOWEST)/bin/python -m pip install --quiet -c $(LOWEST)/constraints.txt -e '.[dev]'
	$(call prebuild_deepspeed,$(LOWEST)/bin)
	$(LOWEST)/bin/python -m pytest 2>&1 | tee $(LOWEST)/pytest.log
	$(LOWEST)/bin/python tools/lowest_versions.py --record $(LOWEST)/pytest.log

CHECK_TESTS := test_lint.py test_layout.py test_chapters.py test_site.py test_screen.py test_mutations.py test_samplers.py test_devices.py test_bucketing.py \
	test_accumulation.py test_allreduce.py

check: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(addprefix tests/,$(CHECK_TESTS))

# Without a GPU it says so in one sentence and exits 0. MNIST must be on this machine (DATA_DIR).
gpu-check: $(VENV)/.installed
	$(BIN)/python tools/gpu_check.py --data-dir $(DATA_DIR)

# A GPU machine with no package index: its own python3 as it is (no venv, the project on PYTHONPATH, nothing
# installed), plus from .gpu/wheels only what it lacks (pip --no-index --no-deps into .gpu/site): tools/gpu_offline.py.
# make gpu-wheels, on a machine with the index, downloads those wheels for the GPU machine's Python (GPU_PYTHON_VERSION):
# datasets and the two of its needs a GPU image usually lacks, torchft with its opentelemetry packages, and
# DeepSpeed (built from its sdist) with its needs, about 10 MB. Carry .gpu/wheels and DATA_DIR along.
GPU_PYTHON ?= python3
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS ?= .gpu/wheels
GPU_WHEEL_SPECS ?= datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchft==0.2.0 opentelemetry-api==1.45.2 \
	opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-proto==1.45.2 \
	opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
	opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2 googleapis-common-protos==1.76.0 \
	hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0 einops==0.8.2 pydantic==2.14.4 pydantic-core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5 psutil==7.2.2
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))

.PHONY: gpu-check-offline gpu-wheels

gpu-check-offline:
	$(GPU_PYTHON) tools/gpu_offline.py --wheels $(GPU_WHEELS) -- --data-dir $(DATA_DIR)

gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --implementation cp --python-version $(GPU_PYTHON_VERSION) \
		$(GPU_PLATFORMS) -d $(GPU_WHEELS) $(GPU_WHEEL_SPECS)
	$(PYTHON) -m pip wheel --no-deps -w $(GPU_WHEELS) deepspeed==0.19.8  # an sdist: built here, pure Python

benchmark: $(VENV)/.installed
	$(BIN)/python benchmarks/mnist_speed.py --data-dir $(DATA_DIR) --plot images/mnist_speed_cpu.png

# Schematics (SVG) are byte-stable: tests/test_figures.py redraws them and compares bytes.
FIGURES := ring_allreduce allreduce_algorithms bucket_assignment accumulation_syncs dp_vs_ddp zero_stages ddp_step_lanes resume_sequence worker_seeds hsdp_mesh overlap_timeline step_time_breakdown compile_breakdown simulate_memory

figures: $(VENV)/.installed
	for figure in $(FIGURES); do $(BIN)/python figures/$$figure.py || exit 1; done
	$(BIN)/python benchmarks/allreduce_speed.py --world-sizes 2 4 --plot images/allreduce_busbw.png

docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

docs-serve: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

# Every page's outputs, on this machine (the pages name it); MNIST from DATA_DIR, as for the demo.
docs-outputs: $(VENV)/.installed
	$(BIN)/python tools/record_outputs.py --data-dir $(DATA_DIR)
