# `make demo` and `make test` work on a fresh machine: each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; a plain `torch` pulls a multi-GB CUDA build. Override as needed,
# e.g. `make test TORCH_SPEC=torch==2.14.1`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# A TICO checkout (or its git directory) for benchmarks/tico_modules.py in `make bench`.
TICO_REPO ?=

.PHONY: demo test lint format docs bench bench-quick wheel-check clean

$(BIN)/fxopt: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,circle,quant]"
	touch $@

demo: $(BIN)/fxopt
	$(BIN)/fxopt demo

# One pytest-xdist worker per core, each test file in one worker (its fixtures built once).
test: $(BIN)/fxopt
	$(BIN)/ruff check src tests benchmarks examples docs/hooks notebooks
	$(BIN)/ruff format --check src tests benchmarks examples docs/hooks notebooks
	$(BIN)/python -m pytest -n auto --dist loadfile

lint: $(BIN)/fxopt
	$(BIN)/ruff check src tests benchmarks examples docs/hooks notebooks
	$(BIN)/ruff format --check src tests benchmarks examples docs/hooks notebooks

format: $(BIN)/fxopt
	$(BIN)/ruff format src tests benchmarks examples docs/hooks notebooks
	$(BIN)/ruff check --fix src tests benchmarks examples docs/hooks notebooks

# The documentation site in build/site: README as the landing page, docs/, RESULTS and
# WRITEUP, the API from docstrings. --strict: a broken link or reference fails the build.
docs: $(BIN)/fxopt
	$(BIN)/python -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Opt-in measurements (minutes to an hour): results/*.json, plots, then RESULTS.md.
bench: $(BIN)/fxopt
	$(BIN)/python -m pip install -q -e ".[peers]"
	$(BIN)/python benchmarks/transform_speed.py
	$(BIN)/python benchmarks/preset_speed.py
	$(BIN)/python benchmarks/guard.py
	$(BIN)/python benchmarks/inference.py
	$(BIN)/python benchmarks/inference.py --threads 2 --out results/inference_2t.json \
		--variants eager "fxopt fx +autotune" "fxopt export +autotune" \
		"fxopt own process" "torch.compile freezing" onnxruntime
	$(BIN)/python -m pip install -q -e ".[hf]"
	$(BIN)/python benchmarks/tiling.py
	$(BIN)/python benchmarks/transformers_speed.py
	$(BIN)/python benchmarks/inference.py --models hf_bert hf_llama_prefill hf_llama_decode \
		--out results/inference_hf.json \
		--variants eager "jit trace+freeze" "fxopt export" "fxopt export +autotune" \
		"fxopt own process" "torch.compile" "torch.compile freezing" onnxruntime
	$(BIN)/python benchmarks/decoder_speed.py
	$(BIN)/python benchmarks/quantize.py
	$(BIN)/python benchmarks/remat_compile.py
	$(BIN)/python benchmarks/remat_step.py --full
	$(BIN)/python benchmarks/remat_ddp.py
	$(BIN)/python benchmarks/remat.py
	$(BIN)/python benchmarks/kernel_gap.py
	# timm without its torchvision dependency (a CUDA build here; see benchmarks/circle_models.py)
	$(BIN)/python -m pip install -q --no-deps timm
	$(BIN)/python benchmarks/circle.py
	# TICO's own module tests, given a TICO checkout: make bench TICO_REPO=path/to/TICO
	test -z "$(TICO_REPO)" || $(BIN)/python benchmarks/tico_modules.py --tico-repo "$(TICO_REPO)"
	$(BIN)/python benchmarks/cli_startup.py
	$(BIN)/python benchmarks/e2e_large.py
	$(BIN)/python benchmarks/memory.py --xl
	$(BIN)/python benchmarks/make_results.py

# The short version (tens of minutes), into results/quick/ so the full figures stay.
QUICK := FXOPT_RESULTS=results/quick
bench-quick: $(BIN)/fxopt
	$(BIN)/python -m pip install -q -e ".[peers,hf]"
	$(QUICK) $(BIN)/python benchmarks/transform_speed.py --sizes 1000 10000
	$(QUICK) $(BIN)/python benchmarks/guard.py --quick
	$(QUICK) $(BIN)/python benchmarks/inference.py --quick
	$(QUICK) $(BIN)/python benchmarks/remat.py --quick
	$(QUICK) $(BIN)/python benchmarks/remat_compile.py --quick
	$(QUICK) $(BIN)/python benchmarks/remat_step.py
	$(QUICK) $(BIN)/python benchmarks/circle.py --quick
	$(QUICK) $(BIN)/python benchmarks/cli_startup.py --repeat 3
	$(QUICK) $(BIN)/python benchmarks/e2e_large.py --model benchmarks/large_graph.py:conv_bn_10k
	$(QUICK) $(BIN)/python benchmarks/memory.py --quick
	$(BIN)/python benchmarks/make_results.py --results results/quick --out results/quick/RESULTS.md

# The built wheel in a fresh venv (torch from TORCH_SPEC): the installed command works.
WHEEL := build/wheel-check
wheel-check: $(BIN)/fxopt
	rm -rf $(WHEEL)
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL)/dist .
	$(PYTHON) -m venv $(WHEEL)/venv
	$(WHEEL)/venv/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(WHEEL)/venv/bin/python -m pip install -q $(WHEEL)/dist/fxopt-*.whl
	cd $(WHEEL) && venv/bin/fxopt --version && venv/bin/fxopt passes \
		&& venv/bin/fxopt optimize zoo:mlp --runs 5

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
