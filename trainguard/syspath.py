"""Keep the working directory from shadowing trainguard's own top-level packages.

``python -m <module>`` puts the working directory first on ``sys.path``. trainguard's services
and warm spares run that way in the user's job directory, where a folder named like one of
trainguard's top-level packages (``schemas``, ``detector``, … — a ``schemas/`` folder is
common) would be imported instead of trainguard's own: seen as ``cannot import name
'DecodeError' from 'schemas'`` in every rank and service. Torch-free and import-free, so that it
can run before anything else is imported.
"""
from __future__ import annotations

import os
import sys


def working_dir_off_path() -> bool:
    """Take the working directory off ``sys.path`` unless trainguard itself lives there (a
    checkout run in place). Returns True when it was taken off. Call it before importing
    trainguard's other modules."""
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cwd = os.getcwd()
    if cwd == home:
        return False
    keep = [p for p in sys.path if os.path.abspath(p or ".") != cwd]
    dropped = len(keep) != len(sys.path)
    sys.path[:] = keep
    return dropped


def working_dir_off_path_under_m() -> None:
    """``working_dir_off_path()`` when this process is ``python -m <package>`` and the package
    is still being imported (``sys.argv[0] == "-m"`` until the module runs, per the Python
    docs): a service package's ``__init__`` calls it, so that ``python -m detector`` in a
    directory holding ``schemas/`` works, while importing the package as a library leaves the
    caller's ``sys.path`` alone."""
    if sys.argv[:1] == ["-m"]:
        working_dir_off_path()
