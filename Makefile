# The two commands a new user runs (see README): `make demo` and `make test`.
# Both create the virtual environment in .venv on first use (scripts/setup.sh).
VENV ?= .venv
ARGS ?=

.PHONY: setup demo test bench-queue

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

demo: setup
	$(VENV)/bin/async-rlhf train --config configs/demo.yaml $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest tests $(ARGS)

bench-queue: setup
	$(VENV)/bin/async-rlhf bench-queue $(ARGS)
