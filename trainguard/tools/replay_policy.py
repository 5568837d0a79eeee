"""Policy changes for a replay (``trainguard replay decide --set`` / ``--policy``): rows that
replace rows of ``remediator.policy_table.TABLE`` (same fault class and layer) or are added to it.

``--set FAULT_CLASS[/LAYER]=ACTION``; a policy file is JSON ``{"rows": [{"fault_class",
"layer", "action", "source"}], "default_mode", "default_retry_budget"}``. Every word is checked
against ``schemas.vocabulary``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Iterable

from trainguard.remediator import policy_table
from trainguard.schemas.vocabulary import Action, FaultClass, Layer

__all__ = ["ReplayError", "Row", "parse_row", "load_policy_file", "policy_with"]


class ReplayError(ValueError):
    """A policy row or a job-record snapshot that cannot be used (the message says which)."""


@dataclass(frozen=True)
class Row:
    """One policy change: ``fault_class`` (``layer`` None: any layer) → ``action``."""

    fault_class: str
    layer: str | None
    action: str
    source: str = "replay override"


def parse_row(text: str) -> Row:
    """``FAULT_CLASS[/LAYER]=ACTION`` → ``Row``. Raises ``ReplayError`` for an unknown word."""
    key, sep, action = text.partition("=")
    fc, _, layer = key.strip().partition("/")
    row = Row(fc, layer or None, action.strip())
    if not sep:
        raise ReplayError(f"--set {text!r}: expected FAULT_CLASS[/LAYER]=ACTION")
    _check_row(row, f"--set {text!r}")
    return row


def _check_row(row: Row, where: str) -> None:
    if row.fault_class not in set(FaultClass):
        raise ReplayError(f"{where}: unknown fault class {row.fault_class!r}; known: "
                          f"{', '.join(FaultClass)}")
    if row.layer is not None and row.layer not in set(Layer):
        raise ReplayError(f"{where}: unknown layer {row.layer!r}; known: {', '.join(Layer)}")
    if row.action not in set(Action):
        raise ReplayError(f"{where}: unknown action {row.action!r}; known: {', '.join(Action)}")


def load_policy_file(path: str) -> tuple[list[Row], dict[str, Any]]:
    """Rows and ``Policy`` settings (``default_mode``, ``default_retry_budget``) of a policy
    file (JSON, see the module docstring). Raises ``ReplayError``."""
    try:
        with open(path) as fh:
            obj = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"--policy {path}: {exc}") from None
    if not isinstance(obj, dict):
        raise ReplayError(f"--policy {path}: expected a JSON object")
    rows = []
    for i, r in enumerate(obj.get("rows", [])):
        try:
            row = Row(r["fault_class"], r.get("layer"), r["action"],
                      r.get("source", f"policy file {path}"))
        except (KeyError, TypeError):
            raise ReplayError(f"--policy {path}: row {i} needs fault_class and action") from None
        _check_row(row, f"--policy {path} row {i}")
        rows.append(row)
    settings = {k: obj[k] for k in ("default_mode", "default_retry_budget") if k in obj}
    return rows, settings


def policy_with(rows: Iterable[Row], base: policy_table.Policy = policy_table.DEFAULT_POLICY,
                **settings: Any) -> policy_table.Policy:
    """``base`` with ``rows`` replacing the table rows of the same fault class and layer (or
    added), and ``settings`` (``Policy`` fields) replaced."""
    table = list(base.table)
    for row in rows:
        new = policy_table.Rule(row.fault_class, row.layer, row.action, row.source)
        at = [i for i, r in enumerate(table)
              if r.fault_class == row.fault_class and r.layer == row.layer]
        if at:
            table[at[0]] = dataclasses.replace(table[at[0]], action=row.action,
                                               source=row.source, requires_spare=False)
        else:
            table.insert(0, new)
    return dataclasses.replace(base, table=tuple(table), **settings)
