# Set-up is part of every target: the venv is created or reused from the pinned requirements.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo venv clean

venv: $(STAMP)

$(STAMP): requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) examples/demo.py

clean:
	rm -rf $(VENV) .cache
