# make demo : set up .venv/ and train the tiny real model on a GSM8K sample, 2 CPU ranks
# make test : set up .venv/, lint the tree (ruff), type-check the engine (mypy) and run the test suite
# make clean: remove .venv/ and work/ (the demo's data and runs)
#
# Everything is installed into the project virtualenv .venv/ (created with $(PYTHON) -m venv):
# torch==2.13.0 from pip's configured index, then sfttrain in editable mode with its test and bench extras.
# The Python that runs make only creates .venv/; its own packages (a CUDA torch, say) stay as they are.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
# torch is pinned first: an unpinned torch would pull the newest build, CUDA's on PyPI for Linux.
# On a CPU-only machine TORCH_INDEX=https://download.pytorch.org/whl/cpu fetches the CPU build.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# what make demo writes (data and run folder), in a folder whose name no sfttrain module has:
# a `data/` here made `sfttrain.data` resolve to it when Python started in the folder above
WORK := work
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

install: $(STAMP)

# Debian's python3 may lack ensurepip (package python3-venv): then the venv is made without pip
# and pip installs itself into it from the calling Python
$(PY):
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV) && $(PYTHON) -m venv --without-pip $(VENV) && \
	  $(PYTHON) -m pip --python $(PY) install -q pip; } || \
	  { echo "cannot create $(VENV): install python3-venv (apt-get install python3-venv)" >&2; exit 1; }

$(STAMP): setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

$(WORK)/gsm8k_sample/train.parquet: | $(STAMP)
	$(PY) data_prep/gsm8k.py --input_dir assets/data/gsm8k --local_dir $(WORK)/gsm8k_sample

demo: $(STAMP) $(WORK)/gsm8k_sample/train.parquet
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) -m sfttrain.run recipes/demo_cpu.yaml

# PYTEST_ARGS: extra pytest flags, e.g. PYTEST_ARGS="-k lora --durations=20"
# TEST_WORKERS: pytest-xdist workers, each running whole test files (--dist loadfile: a file's
# module-scoped runs are made once), in the order tests/conftest.py gives (slowest files first).
# Two pay on 2 cores: interpreter start-ups, rendezvous and one-rank jobs leave a core idle that the
# other worker's test uses (measured: 0.96 of 2 cores busy in one process, 1.7 on 2 workers).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
# a skip not listed in tests/allowed_skips.txt (with the machines it may skip on) fails the suite
# (tests/conftest.py: SkipAudit); ALLOWED_SKIPS= turns the audit off
ALLOWED_SKIPS ?= --allowed-skips=tests/allowed_skips.txt
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ALLOWED_SKIPS) $(PYTEST_ARGS)

clean:
	@echo "make clean: removing $(VENV) (the installed environment: make install or make demo sets it up again) and $(WORK) (the demo's data and runs)"
	rm -rf $(VENV) $(WORK)
