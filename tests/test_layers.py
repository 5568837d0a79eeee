"""Layers run one way: commands → services and rank runtime → rules → core (docs/design.md).

Every product module is put in a layer by the table below (longest matching prefix wins); a
module may import its own layer or a lower one, never a higher one, and the rank runtime never
imports a service. Imports inside functions count too: a lazy import is still a dependency. A
new module that matches no row fails the test until it is placed."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: folder → import package (pyproject's package-dir)
PACKAGES = {"trainguard": "trainguard", "schemas": "trainguard.schemas",
            "agents": "trainguard.agents", "detector": "trainguard.detector",
            "attributor": "trainguard.attributor", "remediator": "trainguard.remediator",
            "checkpoint_validator": "trainguard.checkpoint_validator"}

CORE, RULES, RUNTIME, SERVICE, COMMAND = 1, 2, 3, 3, 4
#: (module prefix, layer, is a service) — the reason is the package's one line in design.md
LAYERS: list[tuple[str, int, bool]] = [
    # core: events, bus, state, the service bases, the checkpoint format
    ("trainguard.schemas", CORE, False), ("trainguard.bus", CORE, False),
    ("trainguard.state", CORE, False), ("trainguard.state_scripts", CORE, False),
    ("trainguard.errors", CORE, False),
    ("trainguard.tracing", CORE, False), ("trainguard.service", CORE, False),
    ("trainguard.consume", CORE, False), ("trainguard.membership", CORE, False),
    ("trainguard.partitions", CORE, False),
    ("trainguard.reducer", CORE, False), ("trainguard.embedded", CORE, False),
    ("trainguard.auth", CORE, False), ("trainguard.tls", CORE, False),
    ("trainguard.metrics", CORE, False), ("trainguard.goodput", CORE, False),
    ("trainguard.auth", CORE, False), ("trainguard.fault_schedule", CORE, False),
    ("trainguard.xid", CORE, False), ("trainguard.checkpoint.format", CORE, False),
    # rules: pure decisions, shared by live services and offline tools
    ("trainguard.detector", RULES, False), ("trainguard.attributor", RULES, False),
    ("trainguard.remediator", RULES, False), ("trainguard.checkpoint_validator", RULES, False),
    ("trainguard.executor", RULES, False),
    ("trainguard.slurm_watch", RULES, False),  # the Slurm watcher's snapshot reader and reducer
    ("trainguard.slurm_commands", RULES, False),  # the Slurm controller's pure commands
    ("trainguard.reputation", RULES, False),  # node reputation and the readmit policy
    ("trainguard.checkpoint.verify", RULES, False),  # the integrity check validator and restore share
    # services (their wiring modules) and the node agent
    ("trainguard.detector.service", SERVICE, True), ("trainguard.attributor.service", SERVICE, True),
    ("trainguard.remediator.service", SERVICE, True),
    ("trainguard.checkpoint_validator.service", SERVICE, True),
    ("trainguard.agents", SERVICE, True), ("trainguard.controllers", SERVICE, True),
    ("trainguard.alerts", SERVICE, True),
    ("trainguard.controller_base", SERVICE, True), ("trainguard.slurm_controller", SERVICE, True),
    ("trainguard.k8s", SERVICE, True),  # Kubernetes: controller, drain handshake, API calls
    ("trainguard.slurm_watch.service", SERVICE, True),
    ("trainguard.slurm_watch.__main__", COMMAND, False),
    ("trainguard.k8s.__main__", COMMAND, False),
    ("trainguard.detector.__main__", COMMAND, False),
    ("trainguard.attributor.__main__", COMMAND, False),
    ("trainguard.remediator.__main__", COMMAND, False),
    ("trainguard.checkpoint_validator.__main__", COMMAND, False),
    ("trainguard.agents.__main__", COMMAND, False),
    # rank runtime: what a training process and its launcher run
    ("trainguard", RUNTIME, False),  # the package: `trainguard.run` (lazily the shim)
    ("trainguard.worker", RUNTIME, False), ("trainguard.hooks", RUNTIME, False),
    ("trainguard.spare", RUNTIME, False), ("trainguard.launch", RUNTIME, False),
    ("trainguard.launch_config", RUNTIME, False), ("trainguard.rank_state", RUNTIME, False), ("trainguard.launcher_pool", RUNTIME, False),
    ("trainguard.forkserver", RUNTIME, False),
    # a restarted Trainer resumes from its newest complete checkpoint; the job's imports,
    # recorded in a rank and pre-imported by the spares' template (docs/frameworks.md)
    ("trainguard.auto_resume", RUNTIME, False), ("trainguard.job_imports", RUNTIME, False),
    ("trainguard.launcher_imports", RUNTIME, False),
    ("trainguard.launcher_lease", RUNTIME, False), ("trainguard.launcher_loop", RUNTIME, False),
    ("trainguard.rendezvous", RUNTIME, False), ("trainguard.rdzv_gate", RUNTIME, False),
    ("trainguard.checkpoint", RUNTIME, False),
    ("trainguard.integrations", RUNTIME, False), ("trainguard.fault_inject", RUNTIME, False),
    ("trainguard.ckpt_request", RUNTIME, False),
    # commands: the CLI and what only it runs
    ("trainguard.cli", COMMAND, False),
    ("trainguard.launcher", COMMAND, False),  # `trainguard launch`: may start a stack
    ("trainguard.launch_args", COMMAND, False), ("trainguard.stack", COMMAND, False),
    ("trainguard.up", COMMAND, False), ("trainguard.credentials", COMMAND, False),
    ("trainguard.demo", COMMAND, False), ("trainguard.diagnose", COMMAND, False),
    ("trainguard.replay", COMMAND, False), ("trainguard.console", COMMAND, False),
    ("trainguard.console_page", COMMAND, False),
    ("trainguard.schemas_cli", COMMAND, False),
    ("trainguard.replay_decide", COMMAND, False), ("trainguard.memstore", COMMAND, False),
    ("trainguard.replay_policy", COMMAND, False),
    ("trainguard.report", COMMAND, False),
    ("trainguard.canary", COMMAND, False),  # the node health canary program
    ("trainguard.node_cli", COMMAND, False),  # `trainguard node readmit|probation|show`
    ("trainguard.cluster", COMMAND, False),  # the one-machine cluster harness (netns, Slurm)
]


def _place(mod: str) -> tuple[int, bool] | None:
    best = None
    for prefix, layer, svc in LAYERS:
        if mod == prefix or (prefix != "trainguard" and mod.startswith(prefix + ".")):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer, svc)
    return None if best is None else best[1:]


def _modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts]
            name = ".".join([pkg, *parts]) if parts != ["__init__"] else pkg
            if folder == "trainguard" and parts and parts[0] in PACKAGES:
                continue
            out[name.removesuffix(".__init__")] = f
    return out


def _imports(mod: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import mod` depends on pkg.mod; `from mod import name` on mod
            found |= {f"{target}.{a.name}" for a in node.names}
    return {f for f in found if f == "trainguard" or f.startswith("trainguard.")}


def test_every_module_is_placed_in_a_layer():
    unplaced = sorted(m for m in _modules() if _place(m) is None)
    assert not unplaced, f"put these modules in a layer of tests/test_layers.py: {unplaced}"


def test_imports_run_one_way():
    mods = _modules()
    bad = []
    for mod, path in sorted(mods.items()):
        here = _place(mod)
        if here is None:
            continue
        for imp in sorted(_imports(mod, path)):
            if imp not in mods and imp.rsplit(".", 1)[0] in mods:
                imp = imp.rsplit(".", 1)[0]  # `from pkg import name`: a name, not a module
            there = _place(imp)
            if there is None or imp == mod or mod.startswith(imp + "."):
                continue
            if there[0] > here[0]:
                bad.append(f"{mod} (layer {here[0]}) imports {imp} (layer {there[0]})")
            elif here[0] == RUNTIME and not here[1] and there[1]:
                bad.append(f"{mod} (rank runtime) imports the service {imp}")
    assert not bad, "\n".join(bad)
