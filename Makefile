# trainguard — quick start: `make demo` runs the main job, `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Users with a GPU bring their own CUDA build of torch; on CPU-only machines this pinned CPU
# build is installed first so that nothing downloads a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test bench clean up

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: install
	$(VENV)/bin/trainguard demo

up: install
	$(VENV)/bin/trainguard up

test: install
	$(PY) -m pytest -q tests

bench: install
	$(PY) bench/attribution.py --corpus ../shared/corpus/failure_logs.jsonl
	$(PY) bench/detector.py
	$(PY) bench/checkpoint.py
	$(PY) bench/recovery.py --quick

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
