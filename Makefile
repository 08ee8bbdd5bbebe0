# Two commands for a newcomer: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvrouter-installed
# pytest-xdist workers: most tests wait on processes and sockets, so more workers than cores
# (6 on 2 cores: 137-138 s warm against 144-148 s with 4, docs/benchmarks.md "The test loop")
TEST_WORKERS ?= 6
# Every test starts Python processes (routers, replicas, publishers) and each xdist worker
# imports every test module: with bytecode caching off (some images set this) each of them
# compiles the sources and re-rewrites the tests' asserts again, a fifth of the suite's CPU.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-compiled lint bench clean compile uncompile

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvrouter demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# The tests of what `make compile` compiles (router/compile.py TESTS): CI runs them against
# the compiled build after the whole suite ran on the sources.
test-compiled: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup \
		$$($(BIN)/python -m router.compile --tests)

# mypy: strict, plus the error codes pyproject [tool.mypy] enables (possibly-undefined, ...),
# over the whole package and the simulator, which holds
# every module `make compile` builds (`python -m router.compile --list`): mypyc refuses what
# mypy rejects. Only the generated gRPC code (router/rpc/gen) is not checked itself.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy router sim

# Optional: the routing core and the service's hot modules compiled with mypyc, in place
# (router/compile.py; the gain: docs/benchmarks.md, "Proxy"; needs a C compiler and the Python
# headers). `make test` / `make test-compiled` then run against the compiled modules.
compile: $(STAMP)
	$(BIN)/python -m router.compile

uncompile:
	$(BIN)/python -m router.compile --clean

bench: $(STAMP)
	$(BIN)/kvrouter bench hash --tokens 1000000 --block-size 64
	$(BIN)/kvrouter bench index --replicas 64 --blocks 10000 --shared 2000 --query 2000
	$(BIN)/kvrouter bench ingest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
