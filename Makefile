# Two commands for a new user: `make demo` and `make test`. Both create .venv and install the project when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/longweave demo --workdir demo_out

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf demo_out .pytest_cache
