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

# Kernel tests run in their own process: without CUDA they need TRITON_INTERPRET=1 from the first import of
# Triton, and the rest of the suite must run the plain PyTorch references instead.
test: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/kernels
	if $(PY) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then \
		$(PY) -m pytest -q tests/kernels; else TRITON_INTERPRET=1 $(PY) -m pytest -q tests/kernels; fi

clean:
	rm -rf demo_out .pytest_cache
