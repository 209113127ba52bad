# Two entry points, as the README says: `make quickstart` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: quickstart test unit integration venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

## Set everything up and show the local example fleet's placement.
quickstart: $(STAMP)
	$(VENV)/bin/llmgw config validate inventory/local/files/server.yaml inventory/local/files/agent.yaml inventory/local/files/hardware/*.yaml
	$(VENV)/bin/llmgw ctl explain --config inventory/local/files/server.yaml --hardware inventory/local/files/hardware/*.yaml

## The whole test suite: unit, then integration (real processes).
test: $(STAMP)
	$(PY) -m pytest tests/unit -q
	$(PY) -m pytest tests/integration -q

unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

integration: $(STAMP)
	$(PY) -m pytest tests/integration -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
