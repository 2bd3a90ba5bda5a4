"""The import graph of src/uniweave: no cycles, and the layering of docs/architecture.md §1.

The graph is read from the source with `ast`, so it holds every import a module can run —
at module level and inside functions (a function-local import that hides a cycle is still
a cycle). `import a.b.c` and `from a.b import c` are edges to the most specific uniweave
module they name (`a.b.c` when it is a module, else `a.b`); the parent packages Python
also initialises are not edges, so a package `__init__` that re-exports its submodules
does not make them cyclic. Imports under `if TYPE_CHECKING:` count too: they state a
dependency all the same. Beyond module cycles, the top-level components (`uniweave.codecs`,
`uniweave.data`, ...) may not import each other both ways.

Layers, lowest first; a module may import only from its own layer or below:

    0 config, core            5 train, eval
    1 codecs, data            6 cli, demo, demo_figures, generate, __main__
    2 models
    3 rollout, replay, forward
    4 rewards, algorithms

Inside `uniweave.train` the sub-packages have an order of their own, lowest first:

    state, distributed     atomic checkpoints, a child's parent; process groups, DDP/FSDP2
    engine                 the loop, its protocols, micro-batching, optimiser, logging,
                           checkpointing, resume policy, retention, diagnostics
    onpolicy               prompts, scoring, stats and Ray workers of rollout methods
    methods.<name>         one method each (sft, grpo, opd): source, objective, job
    run, preflight         what `uniweave train` runs
    layout                 what each entry of a run directory is (`uniweave inspect RUN_DIR`)

A method never imports another method (what two methods share lives lower, in
`onpolicy` or `engine`), and no module imports a private name (`_x`) of another module,
by `from m import _x` or by `m._x` on an imported module.

`demo_figures` (the demo's reward curve and image grids of trained models) and `generate`
(the `uniweave generate` command body) build and drive models and read training metrics, so
they sit with the command line; `demo` runs whole trainings.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "uniweave"

LAYERS: dict[str, int] = {
    "config": 0,
    "core": 0,
    "codecs": 1,
    "data": 1,
    "models": 2,
    "rollout": 3,
    "replay": 3,
    "forward": 3,
    "rewards": 4,
    "algorithms": 4,
    "train": 5,
    "eval": 5,
    "cli": 6,
    "demo": 6,
    "generate": 6,
    "plan": 6,
    "demo_figures": 6,
    "__main__": 6,
}
"""First component under `uniweave` -> layer. `uniweave` itself (the version) is layer 0."""

ALLOWED: dict[tuple[str, str], str] = {}
"""(importer, imported) upward imports tolerated for now, each with its reason."""


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the `uniweave` package under `src`: dotted name -> file."""
    return {module_name(p, src): p for p in sorted((src / ROOT).rglob("*.py"))}


def _resolve(name: str, modules: Iterable[str]) -> str | None:
    """The most specific module of `modules` that `name` names (itself or a parent)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: set[str]) -> dict[str, int]:
    """uniweave modules imported anywhere in `path` (module or function level) -> first line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """module -> {imported uniweave module: line of the first such import}."""
    files = source_modules(src)
    names = set(files)
    return {m: imports_of(m, p, names) for m, p in files.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a closed path a -> ... -> a) per strongly connected component with
    more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.add(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest closed path through the smallest module name of `component`."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    return [*paths[node], start]
                if child in component and child not in paths:
                    paths[child] = [*paths[node], child]
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    if parts[1] not in LAYERS:
        raise KeyError(f"{module}: no layer for uniweave.{parts[1]}; add it to LAYERS")
    return LAYERS[parts[1]]


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """`file:line: importer (layer a) imports target (layer b > a)` for every upward import
    not in `ALLOWED`."""
    out = []
    for module, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            if layer_of(target) > layer_of(module) and (module, target) not in ALLOWED:
                out.append(
                    f"{module.replace('.', '/')}.py:{line}: {module} (layer {layer_of(module)}) "
                    f"imports {target} (layer {layer_of(target)})"
                )
    return out


def test_every_module_has_a_layer():
    for module in source_modules():
        layer_of(module)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def component_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The graph between top-level components (`uniweave.<name>`), without `ALLOWED` edges."""
    out: dict[str, dict[str, int]] = {}
    for module, targets in graph.items():
        source = ".".join(module.split(".")[:2])
        out.setdefault(source, {})
        for target, line in targets.items():
            dest = ".".join(target.split(".")[:2])
            out.setdefault(dest, {})
            if dest != source and (module, target) not in ALLOWED:
                out[source].setdefault(dest, line)
    return out


def test_no_cycles_between_components():
    """Components of one layer (codecs and data, rewards and algorithms, ...) do not import
    each other both ways either."""
    cycles = find_cycles(component_graph(import_graph()))
    assert not cycles, "component cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_respect_the_layers():
    violations = layer_violations(import_graph())
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_allowances_are_still_needed():
    graph = import_graph()
    stale = [pair for pair in ALLOWED if pair[1] not in graph.get(pair[0], {})]
    assert not stale, f"delete these ALLOWED entries, the imports are gone: {stale}"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    """The graph sees function-level and relative imports; a cycle is named as a path."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "def f():\n    from uniweave.models.b import g\n",
            "models/__init__.py": "",
            "models/b.py": "from ..core import a\n",
            "models/c.py": "import uniweave.models.b\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["uniweave.models.b"] == {"uniweave.core.a": 1}
    assert graph["uniweave.models.c"] == {"uniweave.models.b": 1}
    assert find_cycles(graph) == [["uniweave.core.a", "uniweave.models.b", "uniweave.core.a"]]
    assert layer_violations(graph) == [
        "uniweave/core/a.py:2: uniweave.core.a (layer 0) imports uniweave.models.b (layer 2)"
    ]


def test_graph_reads_the_real_tree():
    graph = import_graph()
    assert "uniweave.config" in graph["uniweave.cli"]
    assert "uniweave.core.sample" in graph["uniweave.data.template"]


# -- inside uniweave.train ----------------------------------------------------------------

TRAIN_LAYERS: dict[str, int] = {
    "state": 0,
    "distributed": 0,
    "engine": 1,
    "onpolicy": 2,
    "methods": 3,
    "run": 4,
    "preflight": 4,
    "layout": 4,
}
"""Sub-package (or top-level module) of `uniweave.train` -> its order inside train."""
MAX_TRAIN_TOP_MODULES = 6


def _train_part(module: str) -> tuple[int, str] | None:
    """(order, method or '') of a module under uniweave.train; None outside it or for the
    package itself."""
    parts = module.split(".")
    if parts[:2] != ["uniweave", "train"] or len(parts) < 3:
        return None
    if parts[2] not in TRAIN_LAYERS:
        raise KeyError(f"{module}: no order for uniweave.train.{parts[2]}; add it to TRAIN_LAYERS")
    method = parts[3] if parts[2] == "methods" and len(parts) > 3 else ""
    return TRAIN_LAYERS[parts[2]], method


def train_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """`file:line: why` for every import inside uniweave.train that goes up its order or from
    one method to another."""
    out = []
    for module, targets in sorted(graph.items()):
        here = _train_part(module)
        if here is None:
            continue
        for target, line in sorted(targets.items()):
            there = _train_part(target)
            if there is None:
                continue
            where = f"{module.replace('.', '/')}.py:{line}: {module} imports {target}"
            if here[1] and there[1] and here[1] != there[1]:
                out.append(f"{where} (one method imports another)")
            elif there[0] > here[0]:
                out.append(f"{where} (up the order of uniweave.train)")
    return out


def private_imports(src: Path = SRC) -> list[str]:
    """`file:line: module imports private name` for every `from uniweave.x import _y` and
    every `m._y` where `m` names an imported uniweave module (dunders are not private)."""
    out = []
    for module, path in source_modules(src).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOT):
                for alias in node.names:
                    name = alias.name
                    if name.startswith("_") and not name.startswith("__"):
                        out.append(
                            f"{path.name}:{node.lineno}: {module} imports {node.module}.{name}"
                        )
                    aliases[alias.asname or name] = f"{node.module}.{name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(ROOT) and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                out.append(
                    f"{path.name}:{node.lineno}: {module} uses {aliases[node.value.id]}.{node.attr}"
                )
    return out


def test_train_subpackages_respect_their_order_and_methods_stay_apart():
    violations = train_violations(import_graph())
    assert not violations, "imports inside uniweave.train:\n" + "\n".join(violations)


def test_no_private_names_cross_modules():
    found = private_imports()
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_train_top_level_is_small():
    top = sorted(p.name for p in (SRC / ROOT / "train").glob("*.py"))
    assert len(top) <= MAX_TRAIN_TOP_MODULES, top


def test_train_checks_catch_cross_method_upward_and_private_imports(tmp_path):
    """The meta-test: a GRPO module importing an OPD module, the engine importing a method,
    and a private name taken across modules are each reported."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "train/__init__.py": "",
            "train/engine/__init__.py": "",
            "train/engine/loop.py": "from uniweave.train.methods.sft import job\n",
            "train/methods/__init__.py": "",
            "train/methods/sft/__init__.py": "",
            "train/methods/sft/job.py": "X = 1\n",
            "train/methods/grpo/__init__.py": "",
            "train/methods/grpo/job.py": "from uniweave.train.methods.opd.source import _pool\n",
            "train/methods/opd/__init__.py": "",
            "train/methods/opd/source.py": "def _pool():\n    return 1\n",
            "train/methods/opd/job.py": (
                "import uniweave.train.engine.loop as loop\n\nY = loop._hidden\n"
            ),
        },
    )
    graph = import_graph(tmp_path)
    assert train_violations(graph) == [
        "uniweave/train/engine/loop.py:1: uniweave.train.engine.loop imports "
        "uniweave.train.methods.sft.job (up the order of uniweave.train)",
        "uniweave/train/methods/grpo/job.py:1: uniweave.train.methods.grpo.job imports "
        "uniweave.train.methods.opd.source (one method imports another)",
    ]
    assert sorted(private_imports(tmp_path)) == [
        "job.py:1: uniweave.train.methods.grpo.job imports uniweave.train.methods.opd.source._pool",
        "job.py:3: uniweave.train.methods.opd.job uses uniweave.train.engine.loop._hidden",
    ]


# -- tests/ ------------------------------------------------------------------------------
# A test module never imports another test module (an edit to one would break the other,
# and running one alone would import the other); what several share lives in helper
# modules without the test_ prefix (trainer_helpers, rollout_fixtures, model_fixtures,
# eval_fixtures, tolerances) or in the session fixtures of conftest.py.

TESTS = Path(__file__).resolve().parent


def cross_test_imports(tests: Path = TESTS) -> list[str]:
    """`file:line: importer imports test_x` for every import, at module level or inside a
    function, of a `test_*` module by a `tests/test_*.py` file."""
    out = []
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                if name.split(".")[0].startswith("test_"):
                    out.append(f"{path.name}:{node.lineno}: {path.stem} imports {name}")
    return out


def test_no_test_module_imports_another():
    found = cross_test_imports()
    assert not found, "test modules importing test modules (move the helper):\n" + "\n".join(found)


def test_cross_test_import_check_catches_one(tmp_path):
    """The meta-test: a function-level import of another test module is reported; an import
    of a helper module is not."""
    (tmp_path / "test_a.py").write_text("import os\n\n\ndef test_x():\n    from test_b import h\n")
    (tmp_path / "test_b.py").write_text("from trainer_helpers import tiny_config\n\nh = 1\n")
    assert cross_test_imports(tmp_path) == ["test_a.py:5: test_a imports test_b"]
