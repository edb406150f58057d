"""No module of dlrmflow takes part in an import cycle, and no part imports one above it.

A cycle makes a module's names depend on which of the two was imported first, and ties a
layer to its callers (a kernel that imports the module that dispatches to it). The scan
reads every ``import`` and ``from ... import`` statement of the package's source with
``ast``, those inside functions and under ``if TYPE_CHECKING:`` included: a lazy or
typing-only import still makes the two modules one unit.

The layers, each importing only those below it (``FORBIDDEN`` says what each must not
import; the train stage's folders are ordered among themselves by ``TRAIN_FOLDERS``):

- ``cli``: the ``dlrmflow`` command, on top: it may import every part; of its modules only
  ``cli.bench``, the ``bench`` command, imports the benchmarks (``MODULE_EXCEPTIONS``).
- ``bench``: the benchmarks, which measure the stages and the flows: a flow's benchmark
  imports the flow it runs (``bench.ingest_days`` runs the ingest flow). Nothing but the
  ``bench`` command imports them.
- ``flows``: the Prefect flows, which compose the stages; no flow imports the CLI or a
  benchmark.
- ``score``: batch scoring, above train (it loads its checkpoints and reads with its
  loaders).
- The stages, data flowing one way: ``ingest`` -> ``features`` -> ``train`` (``model``,
  ``planner``, ``run``, ``launch``, ``line``).
- ``kernels``: the embedding bags, interaction and codecs, below every stage.
- ``sparse``: the sparse batch types the kernels look up, below the kernels.
- The modules beside the stages (``config``, the typed configuration, and ``days``,
  ``schema``, ``locks``, ``atomic_writes``, ``memory``, ``supervise``, ``guard``): below
  every stage; none but ``config`` itself imports the configuration.
- ``runtime``: the private pieces of other libraries, below everything but ``errors``.
- ``errors``: the base of every expected failure; it imports nothing of dlrmflow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dlrmflow

PACKAGE_ROOT = Path(dlrmflow.__file__).parent

# Cycles being removed elsewhere: each entry is the exact set of modules of one cycle.
# Delete an entry once its cycle is gone; a cycle that grows beyond its entry fails.
KNOWN_CYCLES: set[frozenset[str]] = set()

# The package's parts (``dlrmflow.PART``): its stage folders, and the modules and folders
# beside them.
STAGES = frozenset({"ingest", "features", "kernels", "train", "score", "flows", "bench", "cli"})
BESIDE = frozenset(
    {"atomic_writes", "config", "days", "errors", "guard", "locks", "memory", "schema", "supervise"}
)
EVERYTHING = STAGES | BESIDE | {"runtime", "sparse"}

# What the modules of each part (``dlrmflow.PART``) must not import.
FORBIDDEN = {
    "ingest": {"features", "train", "score", "flows", "config", "bench", "cli"},
    "features": {"train", "score", "flows", "bench", "cli"},
    "train": {"score", "flows", "bench", "cli"},
    # Batch scoring: above train (it loads its checkpoints and uses its loaders).
    "score": {"flows", "bench", "cli"},
    "flows": {"bench", "cli"},
    # A benchmark may run a flow (it measures it); it is never run by one.
    "bench": {"cli"},
    # The command imports everything; only its ``bench`` command imports the benchmarks.
    "cli": {"bench"},
    "kernels": {"ingest", "features", "train", "score", "flows", "bench", "cli"},
    "config": STAGES,
    # Beside the stages, below them and the configuration.
    **{module: STAGES | {"config"} for module in BESIDE - {"config", "errors"}},
    "errors": EVERYTHING - {"errors"},
    # The sparse batch types (KeyedJaggedTensor, EmbeddingTable): below the kernels, which
    # look them up, and every stage, which builds or shards them.
    "sparse": {
        "ingest",
        "features",
        "train",
        "score",
        "kernels",
        "flows",
        "bench",
        "cli",
        "config",
    },
    # Private and version-specific runtime pieces: below everything, used by any part; a
    # piece with no fallback raises an error of ``errors``.
    "runtime": EVERYTHING - {"runtime", "errors"},
}

# Modules allowed an import their part's rule forbids, as the part's composer: module ->
# the parts it may import.
MODULE_EXCEPTIONS = {"dlrmflow.cli.bench": {"bench"}}

# Imports against the rule, being removed elsewhere: (module, stage it imports), exact.
# Delete an entry once its import is gone (the test says so); a new one fails.
KNOWN_CROSSINGS = {
    # The synthetic generators are configured with the config's DataConfig.
    ("dlrmflow.ingest.synthetic", "config"),
    ("dlrmflow.ingest.synthetic_logs", "config"),
}


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (source file, is a package) for every module under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """For each module of the package at ``root``, the package's modules it imports.

    ``import a.b.c`` and ``from a.b import c`` run ``a``, ``a.b`` and ``a.b.c``; the
    packages above the importing module itself are left out (they are being imported
    already when it runs, so that edge is not a cycle).
    """
    modules = _modules(root)
    package = root.name

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: list[str | None] = []
            if isinstance(node, ast.Import):
                found = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.append(full if full in modules else known(base))
            for target in found:
                if target is None or target.split(".")[0] != package:
                    continue
                for module in [*_ancestors(target), target]:
                    if module != name and module not in _ancestors(name):
                        targets.setdefault(module, node.lineno)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(cycle: frozenset[str], graph: dict[str, dict[str, int]]) -> str:
    """A shortest loop through ``cycle``'s first module, each step as ``module (line N)``,
    N being the line of its import of the next."""
    start = min(cycle)
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:  # breadth first, inside the cycle, back to the start
        reached = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target in cycle and target not in came_from:
                    came_from[target] = module
                    reached.append(target)
        frontier = reached
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    path.reverse()
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:], strict=False)]
    return " -> ".join([*steps, start])


def test_no_module_of_the_package_is_in_an_import_cycle():
    graph = import_graph(PACKAGE_ROOT)
    assert "dlrmflow.kernels.tbe" in graph  # the scan found the package's modules
    new = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(describe(c, graph) for c in new)


def test_the_scan_finds_lazy_relative_and_package_cycles(tmp_path):
    # The scan itself can fail: a synthetic package with a cycle through a function-level
    # relative import, and one through a package's __init__.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .b import g\n")
    (package / "b.py").write_text("import pkg.a\n")
    (package / "sub" / "__init__.py").write_text("from pkg.c import x\n")
    (package / "c.py").write_text("from pkg.sub.d import y\n")
    (package / "sub" / "d.py").write_text("")
    (package / "e.py").write_text("from pkg import a, c\n")  # imports both, in no cycle
    # Three modules in one cycle: f -> g, g -> f and h, h -> g.
    (package / "f.py").write_text("from pkg import g\n")
    (package / "g.py").write_text("import pkg.h\nimport pkg.f\n")
    (package / "h.py").write_text("\n\nfrom pkg.g import z\n")
    graph = import_graph(package)
    assert set(cycles(graph)) == {
        frozenset({"pkg.a", "pkg.b"}),
        frozenset({"pkg.c", "pkg.sub"}),
        frozenset({"pkg.f", "pkg.g", "pkg.h"}),
    }
    assert describe(frozenset({"pkg.a", "pkg.b"}), graph) == (
        "pkg.a (line 2) -> pkg.b (line 1) -> pkg.a"
    )
    assert describe(frozenset({"pkg.f", "pkg.g", "pkg.h"}), graph) == (
        "pkg.f (line 1) -> pkg.g (line 2) -> pkg.f"
    )


def _stage(module: str) -> str:
    """``dlrmflow.STAGE...``'s ``STAGE`` (``""`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def stage_crossings(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], str]:
    """(module, part it must not import) -> where it does, as ``module (line N) -> target``."""
    found: dict[tuple[str, str], str] = {}
    for module, targets in sorted(graph.items()):
        forbidden = FORBIDDEN.get(_stage(module), set()) - MODULE_EXCEPTIONS.get(module, set())
        # The deepest module imported names the import best (its packages come with it).
        for target, line in sorted(targets.items(), key=lambda t: -len(t[0])):
            if _stage(target) in forbidden:
                found.setdefault((module, _stage(target)), f"{module} (line {line}) -> {target}")
    return found


def test_no_stage_imports_a_stage_above_it():
    crossings = stage_crossings(import_graph(PACKAGE_ROOT))
    new = [where for key, where in crossings.items() if key not in KNOWN_CROSSINGS]
    assert not new, "imports against the stage rule:\n" + "\n".join(new)
    gone = sorted(KNOWN_CROSSINGS - crossings.keys())
    assert not gone, f"no longer imported, delete from KNOWN_CROSSINGS: {gone}"


# The train stage's folders, each importing only those before it: the model knows nothing
# of how it is planned, a plan nothing of the run that executes it, a run nothing of how
# its processes were launched.
TRAIN_FOLDERS = ("model", "planner", "run", "launch", "line")


def _train_folder(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "train" and parts[2] in TRAIN_FOLDERS:
        return parts[2]
    return None


def train_folder_crossings(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each import of a train folder by one before it, as ``module (line N) -> target``."""
    found = []
    for module, targets in sorted(graph.items()):
        here = _train_folder(module)
        for target, line in sorted(targets.items()):
            there = _train_folder(target)
            if here and there and TRAIN_FOLDERS.index(there) > TRAIN_FOLDERS.index(here):
                found.append(f"{module} (line {line}) -> {target}")
    return found


def test_no_train_folder_imports_one_after_it():
    graph = import_graph(PACKAGE_ROOT)
    assert {_train_folder(m) for m in graph} >= set(TRAIN_FOLDERS)  # the folders were found
    crossings = train_folder_crossings(graph)
    assert not crossings, "imports against the train folders' order:\n" + "\n".join(crossings)


def test_the_train_folder_scan_finds_an_upward_import():
    graph = {
        "dlrmflow.train.model.dlrm": {"dlrmflow.train.run.loop": 7},
        "dlrmflow.train.run.loop": {"dlrmflow.train.model.dlrm": 3},
        "dlrmflow.train.launch.job": {"dlrmflow.train.run.loop": 2},
    }
    assert train_folder_crossings(graph) == [
        "dlrmflow.train.model.dlrm (line 7) -> dlrmflow.train.run.loop"
    ]


def test_every_part_of_the_package_has_a_rule_and_the_rules_name_real_parts():
    parts = {_stage(m) for m in import_graph(PACKAGE_ROOT)} - {"", "__main__"}
    assert parts == EVERYTHING, "parts without a rule, or rules for parts gone"
    named = set(FORBIDDEN) | {p for forbidden in FORBIDDEN.values() for p in forbidden}
    assert named <= EVERYTHING and set(FORBIDDEN) == EVERYTHING
    for module, allowed in MODULE_EXCEPTIONS.items():
        assert module in import_graph(PACKAGE_ROOT) and allowed <= FORBIDDEN[_stage(module)]


def test_the_stage_scan_finds_imports_in_the_wrong_direction():
    graph = {
        "dlrmflow.flows.train": {"dlrmflow.bench.turns": 4, "dlrmflow.train.run": 3},
        "dlrmflow.cli.run": {"dlrmflow.bench.report": 9, "dlrmflow.flows.train": 2},
        "dlrmflow.cli.bench": {"dlrmflow.bench.report": 5},  # the bench command
        "dlrmflow.bench.ingest_days": {"dlrmflow.flows.ingest": 6},  # measures a flow
        "dlrmflow.runtime.sharded_tensor": {"dlrmflow.errors": 1},
        "dlrmflow.errors": {"dlrmflow.runtime": 8},
        "dlrmflow.memory": {"dlrmflow.config": 2, "dlrmflow.runtime.gomp": 1},
    }
    assert stage_crossings(graph) == {
        ("dlrmflow.flows.train", "bench"): "dlrmflow.flows.train (line 4) -> dlrmflow.bench.turns",
        ("dlrmflow.cli.run", "bench"): "dlrmflow.cli.run (line 9) -> dlrmflow.bench.report",
        ("dlrmflow.errors", "runtime"): "dlrmflow.errors (line 8) -> dlrmflow.runtime",
        ("dlrmflow.memory", "config"): "dlrmflow.memory (line 2) -> dlrmflow.config",
    }
