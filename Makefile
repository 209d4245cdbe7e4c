# `make demo` and `make test` do all the set-up: they create .venv and install
# the pinned dependencies on first use (and again when the pins change).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench docs clean

$(STAMP): pyproject.toml setup.py $(wildcard src/shardkit/*.c src/shardkit/*.h third_party/xxhash/*) requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shardkit demo

# Two workers on CI's 2 cores (the suite waits on subprocesses and disks a third of the time; tests/conftest.py's
# scheduler keeps the S3 tests on one worker and its one server, and starts the long tests first); more where
# there are more cores, at most 4.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadgroup

bench: $(STAMP)
	$(VENV)/bin/shardkit bench $(ARGS)

# The API reference, from the docstrings (pdoc): docs/api/index.html. A broken docstring fails the build.
docs: $(STAMP)
	$(PY) -m pdoc --docformat restructuredtext -o docs/api shardkit '!shardkit.bench'

clean:
	rm -rf $(VENV) build src/*.egg-info src/shardkit/*.so .pytest_cache .hypothesis
