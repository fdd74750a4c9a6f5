# The two commands a newcomer needs: `make up` (run the stack) and `make test`; `make test-fast` while editing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DRAFTER ?= dflash

.PHONY: setup up test test-fast protos bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU build of torch first, pinned, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,bench]'
	# the DFlash and EAGLE-3 references for parity tests; --no-deps: their pins (datasets, openai, ...)
	# serve only their CLIs and training (tests/eagle3_reference.py loads speculators' model files alone)
	$(BIN)/pip install --quiet --no-deps dflash==0.1.0 speculators==0.9.0
	touch $@

up: setup
	$(BIN)/splitspec up --drafter $(DRAFTER)

# -v names each test as it starts (the slow ones are marked `slow`); --durations lists the slowest at the end
test: setup
	@scripts/test_prereqs.sh
	@echo "make test: the whole suite takes about 30 minutes on 2 CPU cores (tests/test_soak.py alone: 1-5 min)"
	$(BIN)/python -m pytest -v -ra --durations=20

# The pure tests: no service process or subprocess (marked `stack` by tests/conftest.py), none marked `slow`
test-fast: setup
	$(BIN)/python -m pytest -q -m "not stack and not slow" --durations=5

protos: setup
	$(BIN)/python scripts/gen_protos.py

bench: setup
	$(BIN)/python bench/bench_target.py

clean:
	rm -rf $(VENV)
