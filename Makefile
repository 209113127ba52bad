# Two entry points, as the README says: `make quickstart` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: quickstart test unit integration ansible venv clean

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

## The whole test suite: unit, then integration (real processes), then the Ansible collection.
test: $(STAMP)
	$(PY) -m pytest tests/unit -q
	$(PY) -m pytest tests/integration -q
	$(MAKE) --no-print-directory ansible

unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

integration: $(STAMP)
	$(PY) -m pytest tests/integration -q

## The llmgw.fleet collection: real ansible-playbook runs (site.yml on this machine,
## every module and role), then ansible-lint and ansible-test sanity.
ansible: $(STAMP)
	$(PY) -m pytest tests/ansible -q -p no:cacheprovider
	VENV=$(abspath $(VENV)) bash tests/ansible/lint.sh lint sanity

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
