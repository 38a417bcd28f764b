# The README's two commands. Both create .venv on first use.
#   make test   - the whole CPU suite (gloo, spawned ranks); what CI runs
#   make test-quick - the `quick` tier: one fast case of each module's core parity, the
#                 loop while editing (under 30 s on 2 cores); make test before pushing
#   make train  - tiny long-context pretraining on CPU with context parallelism
#   make docs-check [UPDATE=1] - rerun the commands the docs quote predictions from
#                 (tools/docs_check.py); UPDATE=1 writes their figures into the docs
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.ctxpar-installed
NPROC   ?= 4
CONFIG  ?= configs/tiny_cpu.yaml

.PHONY: test test-quick train install docs-check clean

$(STAMP): setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned (a newer or unpinned torch drags in GBs of CUDA packages): the CPU
	# build where there is no GPU, the CUDA build where nvidia-smi is found.
	bash tools/install_torch.sh $(BIN)/python
	$(BIN)/pip install --quiet -e .[dev]
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	DS_ACCELERATOR=cpu WANDB_MODE=disabled $(BIN)/python -m pytest -q --durations=30 tests

test-quick: $(STAMP)
	DS_ACCELERATOR=cpu WANDB_MODE=disabled $(BIN)/python -m pytest -q -m quick tests

train: $(STAMP)
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus $(NPROC) \
		--master_port 29611 train.py --config $(CONFIG)

docs-check: $(STAMP)
	$(BIN)/python tools/docs_check.py $(if $(UPDATE),--update)

clean:
	rm -rf $(VENV) runs wandb *.egg-info
