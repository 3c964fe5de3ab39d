# `make demo` and `make test` work on a fresh clone: they create .venv, install torch
# (the pinned CPU build when no torch is present) and terascale, then run.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.terascale-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test demo demo-nvme bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH_PIN)"
	$(VPY) -m pip install -q -e ".[test,examples]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q

# Train (checkpoints every 50 steps), resume from step 100 in a fresh job and compare its
# losses with the uninterrupted run, then consolidate the last checkpoint into one file.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/terascale run --nproc 2 examples/train_gpt.py \
		--config examples/configs/gpt_demo.json --out runs/demo --save-every 50
	OMP_NUM_THREADS=1 $(VENV)/bin/terascale run --nproc 2 examples/train_gpt.py \
		--config examples/configs/gpt_demo.json --out runs/demo_resume \
		--resume-from runs/demo/checkpoints/global_step100 --compare-with runs/demo/metrics.json
	$(VENV)/bin/terascale consolidate runs/demo/checkpoints runs/demo/model.safetensors --dtype bf16

# The same training with optimizer state and parameters in swap files under runs/demo_nvme.
demo-nvme: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/terascale run --nproc 2 examples/train_gpt.py \
		--config examples/configs/gpt_demo_nvme.json --out runs/demo_nvme

bench: $(STAMP)
	$(VPY) bench/step_time.py

clean:
	rm -rf runs .pytest_cache
