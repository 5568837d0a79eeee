"""Layers run one way: commands → services → rank runtime and service base → clients → rules →
core (docs/design.md).

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

CORE, RULES, CLIENTS, RUNTIME, SERVICE, COMMAND = 1, 2, 3, 4, 5, 6
#: (module prefix, layer, is a service): a room of ``trainguard/`` or a design-card folder, and the
#: few modules that sit on another layer than their room; docs/design.md says what each room owns
LAYERS: list[tuple[str, int, bool]] = [
    # core: the events and pure arithmetic, no I/O
    ("trainguard.schemas", CORE, False), ("trainguard.core", CORE, False),
    ("trainguard.checkpoint.format", CORE, False),
    # rules: pure decisions, shared by live services and offline tools
    ("trainguard.detector", RULES, False), ("trainguard.attributor", RULES, False),
    ("trainguard.remediator", RULES, False), ("trainguard.checkpoint_validator", RULES, False),
    ("trainguard.scheduler.slurm.commands", RULES, False),  # the Slurm controller's pure commands
    ("trainguard.scheduler.slurm.watch", RULES, False),  # the Slurm watcher's reader and reducer
    ("trainguard.checkpoint.verify", RULES, False),  # the integrity check validator and restore share
    # clients: the bus, the state store, security
    ("trainguard.clients", CLIENTS, False), ("trainguard.security", CLIENTS, False),
    # rank runtime and the service base: a training process, its launcher, what services share
    ("trainguard", RUNTIME, False),  # the package: `trainguard.run` (lazily the shim)
    ("trainguard.rank", RUNTIME, False), ("trainguard.integrations", RUNTIME, False),
    ("trainguard.checkpoint", RUNTIME, False), ("trainguard.rendezvous", RUNTIME, False),
    ("trainguard.launch", RUNTIME, False), ("trainguard.services", RUNTIME, False),
    # the embedded servers and their parts
    ("trainguard.stack.embedded", RUNTIME, False), ("trainguard.stack.ha", RUNTIME, False),
    ("trainguard.stack.sentinel", RUNTIME, False), ("trainguard.stack.process", RUNTIME, False),
    ("trainguard.stack.statedir", RUNTIME, False), ("trainguard.stack.nats_server", RUNTIME, False),
    ("trainguard.stack.valkey_server", RUNTIME, False), ("trainguard.stack.users", RUNTIME, False),
    ("trainguard.tools.recording", RUNTIME, False),  # the recording file format services write
    # services: their wiring modules, the node agent, the node controllers
    ("trainguard.detector.service", SERVICE, True), ("trainguard.attributor.service", SERVICE, True),
    ("trainguard.remediator.service", SERVICE, True),
    ("trainguard.checkpoint_validator.service", SERVICE, True),
    ("trainguard.agents", SERVICE, True), ("trainguard.scheduler", SERVICE, True),
    ("trainguard.scheduler.slurm.watch.service", SERVICE, True),
    ("trainguard.services.alerts", SERVICE, True),
    # commands: the CLI and what only it runs
    ("trainguard.cli", COMMAND, False), ("trainguard.stack", COMMAND, False),
    ("trainguard.tools", COMMAND, False), ("trainguard.demo", COMMAND, False),
    ("trainguard.cluster", COMMAND, False),  # the one-machine cluster harness (netns, Slurm)
    ("trainguard.launch.launcher", COMMAND, False),  # `trainguard launch`: may start a local stack
    ("trainguard.launch.args", COMMAND, False),
    ("trainguard.agents.canary", COMMAND, False),  # the node health canary program
    ("trainguard.scheduler.slurm.watch.__main__", COMMAND, False),
    ("trainguard.scheduler.k8s.__main__", COMMAND, False),
    ("trainguard.detector.__main__", COMMAND, False),
    ("trainguard.attributor.__main__", COMMAND, False),
    ("trainguard.remediator.__main__", COMMAND, False),
    ("trainguard.checkpoint_validator.__main__", COMMAND, False),
    ("trainguard.agents.__main__", COMMAND, False),
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
            elif here[0] <= RUNTIME and there[1]:
                bad.append(f"{mod} (layer {here[0]}) imports the service {imp}")
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


#: rooms and modules that do I/O: the bus and store clients, the service base, the servers
IO_MODULES = ("trainguard.clients", "trainguard.services", "trainguard.stack", "trainguard.security")
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
            why = ([m] if m.startswith(tuple(p + "." for p in IO_MODULES)) else []) + sorted(_external(mods[m]) & IO_PACKAGES)
            if why:
                chain, at = [], m
                while at:
                    chain.append(at)
                    at = reached[at]
                bad.append(f"{mod} loads {', '.join(why)} via {' ← '.join(chain)}")
                break
    assert not bad, "\n".join(bad)


#: A product module over this many lines is two concepts or more (docs/design.md): split it.
MAX_MODULE_LINES = 500


def test_no_product_module_over_the_size_limit():
    big = sorted(f"{mod} ({n} lines)" for mod, path in _modules().items()
                 if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES)
    assert not big, "split along their concepts: " + ", ".join(big)


def test_the_only_top_level_import_name_is_trainguard():
    """Every folder of the design card installs under ``trainguard`` (pyproject's package-dir):
    nothing else lands at the top of site-packages."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {p.split(".")[0] for p in cfg["packages"]} == {"trainguard"}
    assert set(cfg["package-dir"]) <= set(cfg["packages"])
    # every package folder with an __init__ is listed (a missing one is left out of a wheel)
    listed = set(cfg["packages"])
    for folder, pkg in PACKAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            assert ".".join([pkg, *rel]) in listed, f"{'.'.join([pkg, *rel])} not in pyproject's packages"
