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

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/terascale run --nproc 2 examples/train_gpt.py \
		--config examples/configs/gpt_demo.json --out runs/demo

# The same training with optimizer state and parameters in swap files under runs/demo_nvme.
demo-nvme: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/terascale run --nproc 2 examples/train_gpt.py \
		--config examples/configs/gpt_demo_nvme.json --out runs/demo_nvme

bench: $(STAMP)
	$(VPY) bench/step_time.py

clean:
	rm -rf runs .pytest_cache
