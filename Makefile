# make demo : set up this machine and train the tiny real model on a GSM8K sample, 2 CPU ranks
# make test : set up this machine and run the test suite
PY ?= python3
NPROC ?= 2
STAMP := .make/installed

.PHONY: install demo test clean

install: $(STAMP)

# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
$(STAMP): setup.cfg pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	mkdir -p .make && touch $(STAMP)

data/gsm8k_sample/train.parquet:
	$(PY) data_prep/gsm8k.py --input_dir assets/data/gsm8k --local_dir data/gsm8k_sample

demo: $(STAMP) data/gsm8k_sample/train.parquet
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) -m sfttrain.run recipes/demo_cpu.yaml

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf .make data runs
