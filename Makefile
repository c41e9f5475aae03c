# The two commands a new user runs (see README): `make demo` and `make test`.
# Both create the virtual environment in .venv on first use (scripts/setup.sh).
# `make test` runs the fast tiers first (pure logic and components: `make test-fast`) and stops
# there on a failure; then the tests marked `slow` (real jobs, engines, clusters). Each test runs once.
VENV ?= .venv
ARGS ?=

PYTEST = $(VENV)/bin/python -m pytest tests --durations=25 $(ARGS)

.PHONY: setup demo test test-fast bench-queue

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

demo: setup
	$(VENV)/bin/async-rlhf train --config configs/demo.yaml $(ARGS)

test-fast: setup
	$(PYTEST) -m "not slow"

test: test-fast
	$(PYTEST) -m slow

bench-queue: setup
	$(VENV)/bin/async-rlhf bench-queue $(ARGS)
