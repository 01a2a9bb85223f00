# Two commands on a fresh machine: `make demo` and `make test`. Each creates
# .venv and installs what it needs first. Measured on a 2-core machine from a fresh
# clone, packages from a local mirror (/usr/bin/time, du -sh .venv): make demo's install
# took 26-37 s (two runs) for 713 MB, then its run 40 s; make test took 28 min 51 s in
# all, 24 min 51 s of it the suite of 1021 tests in one process (idle), in a 2.8 GB venv;
# in three workers (pytest-xdist, below) the suite of 1443 tests took 9 min 41 s
# (.ci/run from a fresh clone, idle, 2026-12-07: 10 min 7 s in all).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Not quiet: pip prints each package as it collects and installs it, so a long install shows progress.
PIP := $(BIN)/python -m pip install --disable-pip-version-check --progress-bar on
# A plain path in a .pth, not setuptools' import hook: pyright, mypy and editors then find
# the package from any directory (an import hook is invisible to static tools).
EDITABLE := --config-settings editable_mode=compat -e

.PHONY: demo test quick dev docs plots bench release-check clean

$(BIN)/python:
	@echo "Creating the virtual environment $(VENV) with $(PYTHON)."
	$(PYTHON) -m venv $(VENV)

$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	@echo "Installing eqxckpt into $(VENV) with what the demo needs, for the README's examples too (jax, equinox,"
	@echo "tensorstore, optax, safetensors): 0.7 GB, 26-37 s measured from a local mirror (the network decides)."
	@echo "make test adds TensorFlow, the test servers and the docs toolchain."
	$(PIP) $(EDITABLE) ".[demo]"
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	@echo "Installing eqxckpt into $(VENV) with its test, TensorFlow and docs extras (jax, tensorstore,"
	@echo "tensorflow-cpu, orbax-checkpoint, moto, mkdocs, ...): 2.8 GB; with ruff and pyright, 1 min 44 s measured."
	$(PIP) $(EDITABLE) ".[test,tf,docs]"
	touch $@

# The site needs mkdocs and eqxckpt importable, not TensorFlow nor the test servers: a fresh
# venv with only this extra built it (mkdocs build --strict) after a 32 s install, 982 MB.
$(VENV)/.docs-installed: pyproject.toml | $(BIN)/python
	@echo "Installing eqxckpt into $(VENV) with what the docs site needs (mkdocs, mkdocstrings, matplotlib):"
	@echo "about 1 GB, 32 s measured from a local mirror."
	$(PIP) $(EDITABLE) ".[docs]"
	touch $@

$(VENV)/.bench-installed: pyproject.toml | $(BIN)/python
	@echo "Installing eqxckpt into $(VENV) with its test, TensorFlow and benchmark extras: a few minutes the first time."
	$(PIP) $(EDITABLE) ".[test,tf,docs,bench]"
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/demo.py
	$(BIN)/python examples/readme.py
	@echo "The eqxckpt command is in $(VENV)/bin: run $(VENV)/bin/eqxckpt --help, or source $(VENV)/bin/activate first."

# The suite in three workers that take tests from each other's queue once their own is
# empty (worksteal): a worker no longer idles while another ends a long test file, as
# with a file at a time (loadfile). Many tests wait on worker processes, servers and
# barriers, so a third worker helps on 2 cores: from a fresh clone (.ci/run) the suite
# of 1116 tests took 15 min 04 s with three, 16 min 32 s with two, on the same machine
# the same evening. Each worker peaks at about 4.4 GB.
test: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright
	$(BIN)/python -m pytest -q -n 3 --dist worksteal --durations=25

# The fast loop: no servers, no worker processes, no TensorFlow (tests marked `slow`),
# in two workers.
quick: $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist worksteal

# The test environment alone, for running the suite in parts: .venv/bin/python -m pytest -m s3, ...
# (make demo's .venv has no pytest).
dev: $(VENV)/.test-installed
	@echo "The test environment is in $(VENV): run $(BIN)/python -m pytest, e.g. with -m \"not slow\" or a test file."

docs: $(VENV)/.docs-installed
	$(BIN)/mkdocs build --strict

# Every plot of the docs' benchmark page (docs/img), drawn from the tables in benchmarks/README.md,
# which the page shows: no benchmark is run. After a new run, update those tables, then make plots.
plots: $(VENV)/.test-installed
	$(BIN)/python benchmarks/plot.py

# Sizes, leaf counts and the rest are chosen with BENCH_ARGS, e.g.
# make bench BENCH_ARGS="--sizes 64 336 --leaf-counts 10000 --repeats 3 --no-s3"
bench: $(VENV)/.bench-installed
	@# The checkout's bytecode, as pip writes it for an installed package: where
	@# PYTHONDONTWRITEBYTECODE is set, an editable install compiles every module at each start.
	$(BIN)/python -m compileall -q eqxckpt
	$(BIN)/python benchmarks/bench.py --json benchmarks/results-2cpu.json $(BENCH_ARGS)
	$(BIN)/python benchmarks/checksum_cost.py
	$(BIN)/python benchmarks/verify_speed.py
	$(BIN)/python benchmarks/skipped_bytes.py
	$(BIN)/python benchmarks/decode_bench.py
	$(BIN)/python benchmarks/scan_bench.py
	$(BIN)/python benchmarks/layout_bench.py
	@echo "Put the new figures in benchmarks/README.md's tables, then run make plots to redraw the docs' plots."

# The README's examples up to its T5 section (those read the clone's test fixtures), run as
# examples/readme.py runs them (from a new temporary directory), with the eqxckpt the wheel
# installed, not the clone's.
define README_FROM_THE_WHEEL
import importlib.util, sys
import eqxckpt
assert eqxckpt.__file__.startswith(sys.prefix), f"eqxckpt was imported from {eqxckpt.__file__}, not the venv"
spec = importlib.util.spec_from_file_location("readme", sys.argv[1])
readme = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme)
text = readme.README.read_text()
t5 = text[: text.index("\n## T5")].count("\n") + 2
every = readme.blocks
readme.blocks = lambda: [(line, code) for line, code in every() if line < t5]
readme.main()
print(f"eqxckpt {eqxckpt.__version__} from the wheel, installed in {sys.prefix}, ran them.")
endef
export README_FROM_THE_WHEEL

# A release as a user gets it, built from a copy of the clone (so that no stale egg-info of
# the checkout's is read, and nothing is written into it), all in a temporary directory:
# python -m build makes the sdist, then the wheel from the sdist, each in a build environment
# of its own; twine check --strict reads both; a fresh venv of $(PYTHON) installs the wheel
# with its examples extra and their dependencies (jax, equinox, tensorstore, optax, ...) from
# PyPI, and runs the README's examples from a temporary directory outside the clone.
# Measured on the 2-core machine, packages from a local mirror, pip's cache warm: 32-55 s in
# all (three runs, 55 s with other work running): the build 6 s, the venv and its install
# 20 s, the README's examples 5 s. The suite's test does only the build and twine check.
release-check: $(VENV)/.test-installed
	@set -eu; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; mkdir "$$tmp/src" "$$tmp/run"; \
	echo "Building the sdist and the wheel from a copy of the clone in $$tmp."; \
	tar -c --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./site --exclude=./bench-results \
		--exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache --exclude=.hypothesis -f - . \
		| tar -x -C "$$tmp/src"; \
	$(CURDIR)/$(BIN)/python -m build --outdir "$$tmp/dist" "$$tmp/src"; \
	$(CURDIR)/$(BIN)/python -m twine check --strict "$$tmp"/dist/*; \
	echo "The sdist holds:"; tar tzf "$$tmp"/dist/*.tar.gz; \
	echo "Installing the wheel into a fresh venv, $$tmp/venv, with its dependencies."; \
	$(PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/python" -m pip install --disable-pip-version-check --progress-bar on \
		"$$(ls "$$tmp"/dist/*.whl)[examples]"; \
	cd "$$tmp/run" && "$$tmp/venv/bin/python" -c "$$README_FROM_THE_WHEEL" "$(CURDIR)/examples/readme.py"; \
	"$$tmp/venv/bin/eqxckpt" --help > /dev/null; \
	echo "The release is good: the sdist and the wheel build, pass twine check, install and run."

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build site *.egg-info
