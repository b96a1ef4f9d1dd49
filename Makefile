# sglang-ddtree: set-up, demo, tests, lint, benchmarks.
#
# The environment lives outside the clone, keyed by the pinned versions, so that
# a fresh clone (or CI) reuses it when it exists and builds it when it does not.

PYTHON_BIN   ?= python3.11
TORCH        := 2.14.1
SGLANG       := 0.5.23
ENV_ROOT     ?= $(HOME)/.cache/sglang-ddtree
VENV         ?= $(ENV_ROOT)/venv-py311-torch$(TORCH)-sglang$(SGLANG)
PY           := $(VENV)/bin/python
STAMP        := $(VENV)/.deps-installed
CPU_ENV      := SGLANG_USE_CPU_ENGINE=1
# The lab (benchmarks, model building, the demo) runs from the checkout, beside the package.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
PYTEST_ARGS  ?=

.PHONY: gpu-bundle help venv demo test test-fast test-slow lint format bench-tree bench-moe bench-attention bench-budget ab-smoke \
	pair-eval rank-profile train-pair clean-venv

help:
	@echo "make demo        set up (first run: ~5 min) and run the CPU demo"
	@echo "make test        set up and run the test suite (real SGLang on CPU)"
	@echo "make test-fast   tests that start no server"
	@echo "make test-slow   the slow tests make test leaves out (server soak, ~5-10 min)"
	@echo "make lint        ruff check + format check"
	@echo "make ab-smoke    A/B tool smoke run on the tiny models (CPU)"
	@echo "make pair-eval   acceptance of DDTREE vs the chain on the trained pair (CPU, ~10 min)"
	@echo "make rank-profile  measure the pair's acceptance profile for the replay drafter (CPU, ~1 min)"
	@echo "make train-pair  retrain the small target + DFlash drafter pair (GPU, ~2 min)"
	@echo "make gpu-bundle  build the GPU bundle for the H200 (.carry/gpu; docs/gpu.md)"
	@echo "make bench-tree  tree-kernel benchmark (GPU machine)"
	@echo "make bench-moe   Marlin MoE verify-cost sweep (GPU machine; docs/benchmarks.md)"
	@echo "make bench-attention  MLA tree-verify attention benchmark (GPU machine)"

$(STAMP):
	@mkdir -p $(ENV_ROOT)
	@test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(PY) -m pip install -q torch==$(TORCH)
	$(PY) -m pip install -q sglang==$(SGLANG)
	$(PY) -m pip install -q pytest pytest-timeout "hypothesis>=6" "ruff>=0.6" matplotlib pybind11 tqdm
	@touch $(STAMP)

# Always re-link the package: the environment may have been built by another clone.
venv: $(STAMP)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m sglang_ddtree.cpu install-hook
	$(PY) -m lab.models.tiny > /dev/null

demo: venv
	$(CPU_ENV) $(PY) -m lab.demo

test: venv
	$(CPU_ENV) $(PY) -m pytest -q -p no:cacheprovider --durations=25 -m "not slow" tests $(PYTEST_ARGS)

# Tests marked slow (the server soak, a few minutes): not part of `make test`.
test-slow: venv
	$(CPU_ENV) $(PY) -m pytest -q -p no:cacheprovider --durations=15 -m slow tests $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider -m "not server" tests $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check sglang_ddtree lab tests
	$(PY) -m ruff format --check sglang_ddtree lab tests

format: venv
	$(PY) -m ruff check --fix sglang_ddtree lab tests
	$(PY) -m ruff format sglang_ddtree lab tests

ab-smoke: venv
	$(CPU_ENV) $(PY) -m lab.ab_tiny --arms plain,ddtree,plain+again --concurrency 1 --num-prompts 4 --output-len 24 \
		--repeats 3 --results-dir /tmp/sglang-ddtree-ab-smoke

bench-tree: venv
	$(PY) -m lab.bench.tree_kernels

bench-moe: venv
	$(PY) -m lab.bench.moe_verify --bundle .carry/sgl

bench-attention: venv
	$(PY) -m lab.bench.mla_tree_attention

bench-budget: venv
	$(PY) -m lab.budget_model --out results/kimi-k2.6_h200_budget_code --png

pair-eval: venv
	$(CPU_ENV) $(PY) -m lab.bench.pair_eval

rank-profile: venv
	$(PY) -m lab.bench.pair_rank_profile

train-pair: venv
	$(PY) -m lab.models.train_pair --device cuda --time-limit 2.0

clean-venv:
	rm -rf $(VENV)

gpu-bundle:
	bash gpu/make_bundle.sh
