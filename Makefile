# `make demo` and `make test` work on a fresh clone: they create .venv, install torch
# (the pinned CPU build when no torch is present) and terascale, then run. The demo needs
# terascale and matplotlib only; the suite adds the libraries it is tested with.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
BASE   := $(VENV)/.terascale-installed
STAMP  := $(VENV)/.terascale-test-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test test-all demo demo-nvme bench gpu-check gpu-wheels clean

# The libraries go in with uv, which installs the suite's in seconds where pip takes ~70 s (the
# same versions: torch is already in place, so neither resolves it); pip where uv is not to be had.
# Compiled to bytecode at install, as pip does: else the first process to import a module
# compiles it, and a rank's memory at start then depends on which process came first.
# $(1): the extras of terascale to install with it, editable.
INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(VPY) -e ".[$(1)]" \
	|| $(VPY) -m pip install -q -e ".[$(1)]"
DEMO_EXTRAS := examples
TEST_EXTRAS := test,examples

$(BASE): pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH_PIN)"
	$(VPY) -m pip install -q uv || echo "uv could not be installed: pip installs the libraries"
	$(call INSTALL,$(DEMO_EXTRAS))
	touch $(BASE)

$(STAMP): $(BASE)
	$(call INSTALL,$(TEST_EXTRAS))
	touch $(STAMP)

setup: $(STAMP)

# `make test` leaves out the tests marked slow (the long tail of the architecture sweep)
# to stay within the suite's time budget; `make test-all` runs everything.
# One xdist worker per CPU, each test file on one worker (its module fixtures are built once),
# the longest files first (LONGEST_FIRST in tests/conftest.py);
# tests marked `alone` run with nothing beside them ([Note: tests that run alone] in tests/conftest.py).
XDIST ?= -n logical --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(VPY) -m pytest -q $(XDIST) -m "not slow"

test-all: $(STAMP)
	$(VPY) -m pytest -q $(XDIST)

# Train 100 steps (checkpoints every 25), resume from step 75 in a fresh job and compare its
# losses with the uninterrupted run, then consolidate the last checkpoint into one file.
# (25 resumed steps show a bit-exact resume as well as 50 did, in an eighth less time.)
demo: $(BASE)
	OMP_NUM_THREADS=1 $(VENV)/bin/terascale run --nproc 2 examples/train_gpt.py \
		--config examples/configs/gpt_demo.json --out runs/demo --save-every 25
	OMP_NUM_THREADS=1 $(VENV)/bin/terascale run --nproc 2 examples/train_gpt.py \
		--config examples/configs/gpt_demo.json --out runs/demo_resume \
		--resume-from runs/demo/checkpoints/global_step75 --compare-with runs/demo/metrics.json
	$(VENV)/bin/terascale consolidate runs/demo/checkpoints runs/demo/model.safetensors --dtype bf16

# The same training with optimizer state and parameters in swap files under runs/demo_nvme.
demo-nvme: $(BASE)
	OMP_NUM_THREADS=1 $(VENV)/bin/terascale run --nproc 2 examples/train_gpt.py \
		--config examples/configs/gpt_demo_nvme.json --out runs/demo_nvme

bench: $(STAMP)
	$(VPY) bench/step_time.py

# On a lent GPU machine (no package index there), first thing in the session:
#   make gpu-check GPU_OUT=$OUT        (with .whl/ carried; see DEVELOPERS.md)
# CUDA tests, single-GPU benchmarks against DeepSpeed, the suite's one-rank tests on the GPU;
# summary.json/summary.md/log.txt in GPU_OUT. Without a CUDA device it says so and exits 0.
GPU_OUT    ?= runs/gpu-check
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py --out $(GPU_OUT) $(GPU_ARGS)

# What the GPU machine lacks, as wheels in .whl/ (gitignored; carried to the machine):
# terascale, DeepSpeed as a pure-Python wheel (its ops build there at first use), and the
# config libraries for that machine's Python 3.12.
WHEEL_PY := --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --only-binary=:all:
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(VPY) -m pip wheel -q --no-deps -w .whl .
	DS_BUILD_OPS=0 DS_ACCELERATOR=cuda $(VPY) -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
	$(VPY) -m pip download -q --no-deps $(WHEEL_PY) -d .whl pydantic==2.14.4 pydantic_core==2.50.5 \
		annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0
	@du -sh .whl

clean:
	rm -rf runs .pytest_cache
