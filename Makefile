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

# a second lane on the newest torch this machine's pip installs (the CUDA wheel runs on the
# CPU): the drop-in, hooks, framework and live-recovery tests (.ci/run runs it after `test`)
TORCH_NEXT_SPEC ?= torch==2.14.1
NEXT_VENV ?= .venv-torch-next
NEXT_TESTS = tests/test_hooks.py tests/test_worker.py tests/test_auto_resume.py \
	tests/test_checkpoint_peer.py tests/test_integration_hf.py tests/test_integration_lightning.py \
	tests/test_peer_recovery_e2e.py tests/test_dropin_e2e.py tests/test_integration_e2e.py \
	tests/test_framework_restart_e2e.py

.PHONY: install demo test bench clean up install-torch-next test-torch-next

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

install-torch-next: $(NEXT_VENV)/.installed

$(NEXT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_VENV)/bin/python -m pip install -q --upgrade pip
	$(NEXT_VENV)/bin/python -m pip install -q $(TORCH_INDEX) "$(TORCH_NEXT_SPEC)"
	$(NEXT_VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

test-torch-next: install-torch-next
	$(NEXT_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(NEXT_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup $(NEXT_TESTS)

bench: install
	$(PY) bench/attribution.py --corpus ../shared/corpus/failure_logs.jsonl
	$(PY) bench/detector.py
	$(PY) bench/checkpoint.py
	$(PY) bench/recovery.py --quick

clean:
	rm -rf $(VENV) $(NEXT_VENV) .pytest_cache build *.egg-info
