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
    ("trainguard.state_sentinel", CORE, False),  # the store's client of a replicated Valkey
    ("trainguard.embedded_ha", CORE, False), ("trainguard.embedded_sentinel", CORE, False),
    ("trainguard.breaker_state", CORE, False),  # the fleet breaker's key family of the store
    ("trainguard.errors", CORE, False),
    ("trainguard.tracing", CORE, False), ("trainguard.service", CORE, False),
    ("trainguard.consume", CORE, False), ("trainguard.membership", CORE, False),
    ("trainguard.partitions", CORE, False),
    ("trainguard.reducer", CORE, False), ("trainguard.reducer_service", CORE, False), ("trainguard.embedded", CORE, False),
    ("trainguard.auth", CORE, False), ("trainguard.tls", CORE, False),
    ("trainguard.private_file", CORE, False), ("trainguard.recording", CORE, False),
    ("trainguard.metrics", CORE, False), ("trainguard.goodput", CORE, False),
    ("trainguard.timeline", CORE, False),
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
    ("trainguard.rank_runtime", RUNTIME, False),
    ("trainguard.spare", RUNTIME, False), ("trainguard.launch", RUNTIME, False),
    ("trainguard.launch_config", RUNTIME, False), ("trainguard.rank_state", RUNTIME, False), ("trainguard.launcher_pool", RUNTIME, False),
    ("trainguard.forkserver", RUNTIME, False),
    # a restarted Trainer resumes from its newest complete checkpoint; the job's imports,
    # recorded in a rank and pre-imported by the spares' template (docs/frameworks.md)
    ("trainguard.auto_resume", RUNTIME, False), ("trainguard.job_imports", RUNTIME, False),
    ("trainguard.launcher_imports", RUNTIME, False),
    ("trainguard.launcher_lease", RUNTIME, False), ("trainguard.launcher_loop", RUNTIME, False),
    ("trainguard.rendezvous", RUNTIME, False), ("trainguard.rdzv_gate", RUNTIME, False),
    ("trainguard.rdzv_endpoint", RUNTIME, False),
    ("trainguard.checkpoint", RUNTIME, False),
    ("trainguard.integrations", RUNTIME, False), ("trainguard.fault_inject", RUNTIME, False),
    ("trainguard.ckpt_request", RUNTIME, False),
    # commands: the CLI and what only it runs
    ("trainguard.cli", COMMAND, False),
    ("trainguard.launcher", COMMAND, False),  # `trainguard launch`: may start a stack
    ("trainguard.launch_args", COMMAND, False), ("trainguard.stack", COMMAND, False),
    ("trainguard.up", COMMAND, False), ("trainguard.credentials", COMMAND, False),
    ("trainguard.stack_http", COMMAND, False),
    ("trainguard.demo", COMMAND, False), ("trainguard.diagnose", COMMAND, False),
    ("trainguard.replay", COMMAND, False), ("trainguard.console", COMMAND, False),
    ("trainguard.console_page", COMMAND, False), ("trainguard.console_timeline", COMMAND, False),
    ("trainguard.schemas_cli", COMMAND, False),
    ("trainguard.replay_decide", COMMAND, False), ("trainguard.memstore", COMMAND, False),
    ("trainguard.replay_policy", COMMAND, False),
    ("trainguard.report", COMMAND, False),
    ("trainguard.canary", COMMAND, False),  # the node health canary program
    ("trainguard.node_cli", COMMAND, False),
    ("trainguard.breaker_cli", COMMAND, False),  # `trainguard breaker status|reset`
    ("trainguard.status_cli", COMMAND, False),  # `trainguard status`  # `trainguard node readmit|probation|show`
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


def _graph() -> dict[str, set[str]]:
    """Module → the product modules it imports (lazy imports included)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = set()
        for imp in _imports(mod, path):
            if imp not in mods and imp.rsplit(".", 1)[0] in mods:
                imp = imp.rsplit(".", 1)[0]
            if imp in mods and imp != mod and not mod.startswith(imp + ".") \
                    and not imp.startswith(mod + "."):
                deps.add(imp)
        graph[mod] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative): each is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_circles_are_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    """Two modules that import each other (even lazily, even for a type) are one concept split
    wrongly, or a lower one reaching up: cut the circle where it belongs."""
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" ↔ ".join(c) for c in circles)


#: modules that do I/O: the bus and store clients, the service bases, the embedded servers
IO_MODULES = ("trainguard.service", "trainguard.reducer_service", "trainguard.bus",
              "trainguard.state", "trainguard.consume", "trainguard.membership",
              "trainguard.embedded")
IO_PACKAGES = frozenset({"nats", "redis", "fastapi", "uvicorn", "aiohttp", "kubernetes_asyncio"})


def _external(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_rules_import_no_io():
    """A rule module (layer ``RULES``, not a service) and everything it imports, however
    deep, load no bus, store, service base or I/O package: importing a rule is pure."""
    graph, mods = _graph(), _modules()
    bad = []
    for mod in sorted(graph):
        here = _place(mod)
        if here is None or here[0] != RULES or here[1]:
            continue
        reached = {mod: ""}
        todo = [mod]
        while todo:
            m = todo.pop()
            for d in graph[m]:
                if d not in reached:
                    reached[d] = m
                    todo.append(d)
        for m in sorted(reached):
            why = ([m] if m in IO_MODULES else []) + sorted(_external(mods[m]) & IO_PACKAGES)
            if why:
                chain, at = [], m
                while at:
                    chain.append(at)
                    at = reached[at]
                bad.append(f"{mod} loads {', '.join(why)} via {' ← '.join(chain)}")
                break
    assert not bad, "\n".join(bad)
