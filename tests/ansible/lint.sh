#!/usr/bin/env bash
# Quality gates of the llmgw.fleet collection, both with empty ignore files:
#   ansible-lint (production profile, offline) over playbooks, roles, molecule scenarios and inventories;
#   ansible-test sanity on Python 3.11, run in place in the collection.
# Exits non-zero on any finding. Usage: tests/ansible/lint.sh [lint|sanity]...
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${VENV:-$root/.venv}
collection=$root/collections/ansible_collections/llmgw/fleet
export PATH="$venv/bin:$PATH"
export ANSIBLE_CONFIG=$root/ansible.cfg

run_lint() {
  cd "$root"
  ansible-lint --offline --profile production -c tests/ansible/ansible-lint.yml \
    playbooks collections/ansible_collections/llmgw/fleet/roles collections/ansible_collections/llmgw/fleet/extensions inventory
}

# ansible-test builds a virtualenv per sanity test and bootstraps pip in it from a
# script it downloads from its own file server, which is out of reach here. The
# bootstrap is only "install pip into an empty venv": Python's ensurepip does that
# from the wheel it ships, and the pinned test requirements then come from the
# package index pip is configured with.
seed_pip_bootstrap() {
  local cache
  # ansible-test's internals, read in one place and guarded by test_ansible_test_bootstrap.py
  cache=$(python "$root/tests/ansible/ansible_test_bootstrap.py")
  [ -f "$cache" ] && grep -q 'llmgw' "$cache" && return 0
  mkdir -p "$(dirname "$cache")"
  cat >"$cache" <<'PY'
"""Stand-in for get-pip.py (written by llmgw's tests/ansible/lint.sh): ensurepip's
bundled pip, then pip installs the requested packages with the machine's pip config.
ensurepip runs in a child process because it points PIP_CONFIG_FILE at /dev/null."""
import subprocess
import sys

GET_PIP_ONLY = ("--no-setuptools", "--no-wheel")
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade", "--default-pip"], stdout=subprocess.DEVNULL)
args = [a for a in sys.argv[1:] if a not in GET_PIP_ONLY]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", "--quiet"] + args))
PY
}

run_sanity() {
  seed_pip_bootstrap
  cd "$collection"
  ansible-test sanity --python 3.11 --color no
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(lint sanity)
for step in "${steps[@]}"; do
  case $step in
    lint) run_lint ;;
    sanity) run_sanity ;;
    *) echo "unknown step $step (lint|sanity)" >&2; exit 2 ;;
  esac
done
