# trainguard — quick start: `make demo` runs the main job, `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first, pinned: TORCH_SPEC. From PyPI, on Linux x86_64, that is the CUDA
# build (several GB); for the CPU build name PyTorch's CPU index in TORCH_INDEX, e.g.
#   make install TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
# (a machine whose pip is configured with a local wheel of it needs neither).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install demo test bench clean up

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: install
	$(VENV)/bin/trainguard demo

up: install
	$(VENV)/bin/trainguard up

# two workers (pytest-xdist): a test module runs whole on one of them, the modules that take
# host-wide resources (the one-machine cluster, Slurm) one after another (tests/conftest.py)
test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

bench: install
	$(PY) bench/attribution.py --corpus ../shared/corpus/failure_logs.jsonl
	$(PY) bench/detector.py
	$(PY) bench/checkpoint.py
	$(PY) bench/recovery.py --quick

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
