# Quick start: `make demo` and `make test`. Both create .venv when it is missing
# and install the project into it (editable) before running: `make demo` only what the
# demo needs (.[demo]), `make test` everything the tests use (.[dev], then PyTorch).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# One stamp per install, so neither redoes or undoes the other: .[dev] holds everything
# .[demo] does, and pip keeps what is installed when it still satisfies a requirement.
STAMP := $(VENV)/.installed-dev
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST_ARGS ?=

export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONUNBUFFERED = 1

.PHONY: demo test test-fast test-jax test-torch test-long test-tf221 fuzz install install-torch \
	bench bench-quick data-glyphs clean help

help:
	@echo "make demo   - set up .venv with the demo's extras only and run the end-to-end"
	@echo "              demo on bundled data"
	@echo "make test   - set up .venv and run the test suite (TensorFlow, then the loss,"
	@echo "              model and multi-stage tests again on JAX and on PyTorch)"
	@echo "make test-fast - every test not marked slow, on TensorFlow (under 5 minutes)"
	@echo "make test-jax / make test-torch - only those tests, on JAX / PyTorch"
	@echo "              (test-torch installs a CPU build of PyTorch into .venv first)"
	@echo "make test-tf221 - the tests not marked slow on TensorFlow 2.21, in a venv of"
	@echo "              their own without ScaNN (which needs 2.20): .cache/venv-tf221"
	@echo "              (about 37 minutes with installing, on 2 busy cores)"
	@echo "make test-long - the tests marked long: tfaploss train across processes,"
	@echo "              real small-tmpfs training runs, serving under load (not in make test)"
	@echo "make fuzz   - property-based fuzzing (tests/fuzz): the losses (also on PyTorch),"
	@echo "              the config loader, damaged records, the serving signature;"
	@echo "              thousands of cases in minutes, FUZZ_SEED=n, failures kept"
	@echo "make bench  - the performance suite, one summary table (long);"
	@echo "              make bench-quick: the same in a few minutes;"
	@echo "              make bench TINY=1: toy sizes, a check that it runs"
	@echo "make data-glyphs - fetch Debian's CJK fonts (apt-get download, not installed)"
	@echo "              and render the glyph retrieval set into data/glyphs/"
	@echo "              (FONTS=folder: use your own font files instead)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(STAMP): setup.py | $(BIN)/python
	$(BIN)/python -m pip install -e ".[dev]"
	@touch $(STAMP)

$(DEMO_STAMP): setup.py | $(BIN)/python
	$(BIN)/python -m pip install -e ".[demo]"
	@touch $(DEMO_STAMP)

install: $(STAMP)

# PyTorch for test-torch, CPU build only: PyPI's default Linux wheel pulls several GB
# of CUDA libraries; the CPU wheel is ~190 MB (~900 MB installed; 40-90 s on 2 cores). A
# torch already in .venv is kept. First a plain pip install of the +cpu release (found
# where pip is configured with a local wheel folder), else from PyTorch's CPU index.
# Then pytorch-metric-learning, the losses benchmark's peer (tests/test_benchmarks.py),
# only once torch is there: installed before it, it would pull PyPI's CUDA torch.
# torch requires setuptools>=77; setuptools 81 deprecates and 82 drops pkg_resources,
# which the `tensorboard` command imports, hence the cap.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_STAMP := $(VENV)/.installed-torch
TORCH_PIP := $(BIN)/python -m pip install "torch==$(TORCH_VERSION)+cpu" "setuptools>=77.0.3,<81"

$(TORCH_STAMP): $(STAMP)
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "PyTorch already in $(VENV): keeping it"; \
	else \
		$(TORCH_PIP) || { echo "trying PyTorch's CPU index $(TORCH_INDEX)"; \
			$(TORCH_PIP) --extra-index-url $(TORCH_INDEX); }; \
	fi
	$(BIN)/python -m pip install "pytorch-metric-learning>=2.9"
	@touch $(TORCH_STAMP)

install-torch: $(TORCH_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/tfaploss demo

# The tests mirror the package (tests/losses/, tests/pipelines/, ...). Keras fixes its
# backend at import, so each backend gets its own process: the main run checks every test
# on TensorFlow; test-jax and test-torch run these folders again on the other backends,
# where tests/conftest.py deselects the tests marked `tensorflow` (TensorFlow APIs).
BACKEND_TESTS := tests/losses tests/ops tests/models tests/training

# The TensorFlow suite runs on 2 worker processes (pytest-xdist): every test makes its
# own files under tmp_path and picks free ports. PYTEST_WORKERS=0 runs it in one process.
# A file's tests stay on one worker (--dist loadfile), so a module fixture (a trained
# run, an export) is built once, not once per worker: 10 % less CPU on the five files
# with the largest fixtures (390 s against 431 s of user time, same machine).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile

test: $(STAMP) $(TORCH_STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not long" $(PYTEST_ARGS)
	$(MAKE) test-jax
	$(MAKE) test-torch

# The tests marked `long` (minutes each on 2 cores): `tfaploss train` across processes
# under torchrun and JAX's coordinator (2 processes = 1, SIGTERM and SIGKILL + restart),
# real small tmpfs runs of tfaploss train, serving under concurrent load, a run killed at
# every point of its writes, Ctrl-C, a full disk at every file a run writes. Kept out of
# `make test` so that it stays within its 15 minutes. Run them before changing the run
# folder, the process group, the jobs' publishing or the export.
test-long: $(STAMP) $(TORCH_STAMP)
	$(BIN)/python -m pytest -m long $(PYTEST_ARGS)
	KERAS_BACKEND=jax $(JAX_TEST_ENV) \
		XLA_FLAGS="$(JAX_TEST_XLA) --xla_force_host_platform_device_count=4" \
		$(BIN)/python -m pytest $(PYTEST_ARGS) tests/distribute/test_train_jax.py
	KERAS_BACKEND=torch $(BIN)/python -m pytest $(PYTEST_ARGS) tests/distribute/test_train_torch.py

# Every test not marked `slow` (end-to-end runs, killed and multi-process jobs), once,
# on TensorFlow: the loop while editing, under 5 minutes on 2 cores. The same tests on
# JAX and PyTorch are `make test-jax` / `make test-torch`, and `make test` runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not slow and not long" $(PYTEST_ARGS)

# On 2 worker processes too: 1.5x faster than one (553 s against 822 s, same machine),
# since one JAX process leaves the second core mostly idle. keras.distribution's
# DataParallel on 4 host devices: a process of its own, since the device count is fixed
# when JAX starts. The tests' tensors are small, so compiling is most of their time:
# without LLVM's optimisation passes (same HLO, same arithmetic, no fast-math) the run
# took 369 CPU s against 513. JAX's persistent compilation cache keeps every compiled
# computation, the op-by-op ones of eager JAX included (no minimum compile time; 30 MB):
# the backend tests took 3:36 from an empty cache and 1:49 from a warm one, against 4:29
# and 3:11 when only compiles over 0.2 s were kept (2 quiet cores). It lives in the
# user's cache folder, not the checkout, so that a fresh clone or a second worktree
# starts warm; its key holds the jax/jaxlib versions and flags, so a stale entry is
# never used. JAX_TEST_CACHE=folder moves it; `make clean` empties it.
JAX_TEST_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tfaploss/jax-tests
JAX_TEST_ENV := JAX_COMPILATION_CACHE_DIR=$(JAX_TEST_CACHE) \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
JAX_TEST_XLA := --xla_backend_optimization_level=0
test-jax: $(STAMP)
	KERAS_BACKEND=jax $(JAX_TEST_ENV) XLA_FLAGS="$(JAX_TEST_XLA)" \
		$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS) $(BACKEND_TESTS)
	KERAS_BACKEND=jax $(JAX_TEST_ENV) \
		XLA_FLAGS="$(JAX_TEST_XLA) --xla_force_host_platform_device_count=4" \
		$(BIN)/python -m pytest $(PYTEST_ARGS) tests/distribute/test_jax.py

# torch.distributed (4 local gloo ranks forked from the test process): a process of its
# own, so that the ranks fork from a fresh one. `tfaploss train` under torchrun and JAX's
# coordinator (test_train_torch.py, test_train_jax.py) runs in `make test-long`, each in a
# pytest process of its own: the torch one trains in its test process too.
test-torch: $(TORCH_STAMP)
	KERAS_BACKEND=torch $(BIN)/python -m pytest $(PYTEST_ARGS) $(BACKEND_TESTS)
	KERAS_BACKEND=torch $(BIN)/python -m pytest $(PYTEST_ARGS) tests/distribute/test_torch.py

# TensorFlow 2.21: setup.py allows it, but .[dev] holds ScaNN 1.4.2, which needs 2.20, so
# the main suite never sees 2.21. This runs the tests not marked slow on 2.21, in a venv
# of its own with the extras that do not cap TensorFlow; the tests of ScaNN, keras-hub,
# JAX and PyTorch skip themselves there. Figures: docs/contributing.md.
TF221_VENV := .cache/venv-tf221
TF221_STAMP := $(TF221_VENV)/.installed
$(TF221_STAMP): setup.py
	$(PYTHON) -m venv $(TF221_VENV)
	$(TF221_VENV)/bin/python -m pip install --upgrade pip
	$(TF221_VENV)/bin/python -m pip install -e ".[beam,faiss,demo,compare,tfds,test]" \
		"tensorflow==2.21.*"
	@touch $(TF221_STAMP)

test-tf221: $(TF221_STAMP)
	$(TF221_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

# Property-based fuzzing (tests/fuzz, hypothesis): every loss, the config loader, damaged
# records through `tfaploss verify` and the readers, the serving signature on mutated
# images; thousands of cases with the "fuzz" profile (`make test` runs its "ci" slice).
# FUZZ_SEED fixes the draws; failures are kept in .cache/hypothesis and replayed first
# the next time. The losses run again on PyTorch (cheap); not on JAX, where every new
# batch shape compiles (KERAS_BACKEND=jax pytest tests/fuzz/test_losses.py: 3 shapes,
# 3 minutes for the short slice). Ends with the table of docs/reliability.md, "Fuzzing".
FUZZ_SEED ?= 48
FUZZ_REPORT := $(CURDIR)/.cache/fuzz-report
FUZZ_PYTEST := $(BIN)/python -m pytest -p no:cacheprovider --hypothesis-profile=fuzz \
	--hypothesis-seed=$(FUZZ_SEED) $(PYTEST_ARGS)
fuzz: $(TORCH_STAMP)
	rm -rf $(FUZZ_REPORT)
	status=0; \
	TFAPLOSS_FUZZ_REPORT=$(FUZZ_REPORT) $(FUZZ_PYTEST) -n $(PYTEST_WORKERS) tests/fuzz \
		|| status=1; \
	KERAS_BACKEND=torch TFAPLOSS_FUZZ_REPORT=$(FUZZ_REPORT) $(FUZZ_PYTEST) \
		tests/fuzz/test_losses.py || status=1; \
	$(BIN)/python tests/fuzz/report.py $(FUZZ_REPORT); exit $$status

# The performance suite (benchmarks/suite.py): every benchmark, one summary table.
# QUICK=1 (or bench-quick): a few minutes on 2 cores; TINY=1: toy sizes, the check the
# suite's test runs (its numbers mean nothing); PREVIOUS=file: an earlier suite results
# file whose ratios are shown beside this run's.
QUICK ?=
TINY ?=
PREVIOUS ?=
bench: $(STAMP)
	$(BIN)/python benchmarks/suite.py $(if $(QUICK),--quick) $(if $(TINY),--tiny) \
		$(if $(PREVIOUS),--previous $(PREVIOUS))

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/suite.py --quick $(if $(PREVIOUS),--previous $(PREVIOUS))

# The glyph retrieval set (tfaploss/pipelines/glyphs.py): one class per CJK character, one image
# per font face. Without FONTS, Debian's CJK font packages are downloaded and unpacked
# into data/fonts/ (tfaploss/pipelines/fetch_fonts.sh; nothing is installed); FONTS=folder reads
# any folder of .ttf/.otf/.ttc/.otc files instead. GLYPHS_ARGS: more job options.
FONTS ?=
GLYPHS_ARGS ?=
data-glyphs: $(STAMP)
ifeq ($(strip $(FONTS)),)
	sh tfaploss/pipelines/fetch_fonts.sh data/fonts
	$(BIN)/python -m tfaploss.pipelines.glyphs --input_dir data/fonts/extracted \
		--output_dir data/glyphs $(GLYPHS_ARGS)
else
	$(BIN)/python -m tfaploss.pipelines.glyphs --input_dir $(FONTS) --output_dir data/glyphs \
		$(GLYPHS_ARGS)
endif

clean:
	rm -rf $(VENV) build *.egg-info $(JAX_TEST_CACHE) $(TF221_VENV)
