"""No module of dlrmflow outside ``dlrmflow/runtime/`` uses a private name of another library.

A library's private names (one leading underscore) change or vanish between releases
without notice; ``dlrmflow.runtime`` holds every use of them, each module saying what it
reaches into, the version it was written against, what it gains and what runs where the
piece is gone. This test keeps them there. It reads the package's source with ``ast`` and
reports each use outside ``runtime/`` as ``file:line: name``, where a use is:

1. an import of another library's private module or name: a component of the module path,
   or an imported name, starting with one underscore (``import torch.distributed._shard``,
   ``from torch._dynamo import config``, ``from torch import _C``);
2. a private attribute along a chain whose root an import of another library binds
   (``torch._assert_async``, ``torch.ops.mkldnn._is_mkldnn_bf16_supported``,
   ``np.lib._x``, ``Writer._flush`` after ``from lib import Writer``), named by its
   dotted path up to the first private part;
3. a private attribute, on any object (``self`` included), that dlrmflow defines nowhere:
   no ``def _x``, no ``... ._x = ...``, no class or module attribute ``_x``, no
   ``setattr(..., "_x", ...)`` or ``register_buffer("_x", ...)``. Such a name can only be
   a library's
   (``writer._get_file_writer()``, ``self._buffers`` in a subclass of ``nn.Module``);
4. the instance state of the library objects dlrmflow holds, on any object but ``self``
   and ``cls``, even where dlrmflow names an attribute of its own the same way: the
   private attributes of an ``nn.Module``, a ``numpy.memmap`` and a ``torch.optim``
   optimizer, read from live instances (``module._parameters``, ``memmap._mmap``);
5. an import of ``ctypes`` or ``cffi``: a C library's symbols, past any Python API.

``getattr``, ``hasattr``, ``setattr`` and ``delattr`` with a constant name count as the
attribute. Never flagged: dunders (``__version__``), dlrmflow's own modules and what they
define, ``self._x`` and ``cls._x`` of dlrmflow's own attributes, and the underscore names
Python documents as public (``os._exit``; a named tuple's ``_replace``, ``_asdict``,
``_fields``, ``_make``, ``_field_defaults``).

What the scan cannot see, knowing no types: a private attribute that dlrmflow also defines
for itself, reached on a library object, outside rule 4's instance state; and a dlrmflow
class overriding a library's private method (``def _apply``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import dlrmflow

PACKAGE_ROOT = Path(dlrmflow.__file__).parent
REPO = PACKAGE_ROOT.parent

# Private uses in files being changed elsewhere (issue 40): (file, name), exact, each with
# its replacement. Delete an entry once its use is gone (the test says so); a new use fails.
KNOWN_PRIVATE_USES: set[tuple[str, str]] = set()

# Underscore names that Python documents as public.
DOCUMENTED_PUBLIC = {"os._exit"}
DOCUMENTED_PUBLIC_ATTRIBUTES = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
NATIVE_MODULES = {"ctypes", "cffi"}
ATTRIBUTE_CALLS = {"getattr", "hasattr", "setattr", "delattr"}
# nn.Module's methods that define an attribute by the name they are given first.
REGISTERING = {"register_buffer", "register_parameter", "register_module", "add_module"}


@dataclass(frozen=True, order=True)
class PrivateUse:
    """One use of another library's private name, as the failure reports it."""

    path: str  # relative to the package's parent: "dlrmflow/kernels/tiered.py"
    line: int
    name: str  # "torch.distributed._shard", "._mmap", "ctypes"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _up_to_private(dotted: str) -> str | None:
    """``dotted`` cut after its first private part; None when no part is private."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            return ".".join(parts[: i + 1])
    return None


def library_state_names(scratch: Path) -> frozenset[str]:
    """Rule 4: the private attributes that instances of the library classes dlrmflow holds
    carry, read from live ones (``scratch``: a directory for a memmap's file)."""
    file = scratch / "memmap.bin"
    file.write_bytes(bytes(8))
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    instances = [nn.Module(), np.memmap(file, np.uint8, "r"), optimizer]
    return frozenset(name for obj in instances for name in vars(obj) if _private(name))


def _sources(root: Path) -> dict[str, ast.Module]:
    return {
        path.relative_to(root.parent).as_posix(): ast.parse(path.read_text(), str(path))
        for path in sorted(root.rglob("*.py"))
    }


def _constant_name(call: ast.Call) -> str | None:
    """The constant attribute name of ``getattr(x, "_y")`` and its kin."""
    if len(call.args) >= 2 and isinstance(call.args[1], ast.Constant):
        value = call.args[1].value
        return value if isinstance(value, str) else None
    return None


def _calls_to(call: ast.Call, names: set[str]) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in names
    # object.__setattr__(self, "_x", v), as frozen dataclasses set their fields.
    return isinstance(func, ast.Attribute) and func.attr in {f"__{n}__" for n in names}


def defined_names(trees: dict[str, ast.Module]) -> set[str]:
    """Every private name the package defines: functions, classes, attributes it assigns,
    class and module attributes, ``__slots__``, ``setattr`` names and the buffers,
    parameters and submodules it registers."""
    defined: set[str] = set()
    for tree in trees.values():
        bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in bodies:
            for statement in body:
                targets: list[ast.expr] = []
                if isinstance(statement, ast.Assign):
                    targets = statement.targets
                elif isinstance(statement, ast.AnnAssign | ast.AugAssign):
                    targets = [statement.target]
                for target in targets:
                    for node in ast.walk(target):
                        if isinstance(node, ast.Name):
                            defined.add(node.id)
                for target in targets:
                    if isinstance(target, ast.Name) and target.id == "__slots__":
                        defined.update(
                            n.value
                            for n in ast.walk(statement.value)
                            if isinstance(n, ast.Constant) and isinstance(n.value, str)
                        )
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
                defined.add(node.attr)
            elif isinstance(node, ast.Call) and _calls_to(node, {"setattr"}):
                name = _constant_name(node)
                if name is not None:
                    defined.add(name)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in REGISTERING
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                defined.add(node.args[0].value)  # self.register_buffer("_x", ...)
    return {name for name in defined if _private(name)}


def _import_bindings(tree: ast.Module, package: str) -> dict[str, str | None]:
    """Each name an import binds -> the dotted path it stands for; None for the package's
    own (and relative) imports."""
    bound: dict[str, str | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                own = alias.name.split(".")[0] == package
                if alias.asname:
                    bound[alias.asname] = None if own else alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = None if own else top
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            own = node.level > 0 or module.split(".")[0] == package
            for alias in node.names:
                bound[alias.asname or alias.name] = None if own else f"{module}.{alias.name}"
    return bound


def _chain(node: ast.Attribute) -> tuple[ast.expr, list[str]]:
    """``a.b.c``'s root expression (``a``) and attribute names (``["b", "c"]``)."""
    names = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        names.append(value.attr)
        value = value.value
    return value, names[::-1]


def private_uses(
    root: Path, state_names: frozenset[str], exempt: str = "runtime"
) -> list[PrivateUse]:
    """Every use of another library's private name in the package at ``root``, outside its
    ``exempt`` subpackage (rules 1-5 of this module's docstring)."""
    package = root.name
    trees = _sources(root)
    defined = defined_names(trees)
    exempt_prefix = f"{package}/{exempt}/"
    found: set[PrivateUse] = set()
    for path, tree in trees.items():
        if not path.startswith(exempt_prefix):
            scan = _FileScan(path, _import_bindings(tree, package), defined, state_names)
            found.update(scan.uses(tree, package))
    return sorted(found)


@dataclass
class _FileScan:
    """The private uses of one file: ``bound`` are its import bindings, ``defined`` the
    package's own private names, ``state_names`` rule 4's."""

    path: str
    bound: dict[str, str | None]
    defined: set[str]
    state_names: frozenset[str]

    def uses(self, tree: ast.Module, package: str) -> set[PrivateUse]:
        found: set[PrivateUse] = set()
        for node in ast.walk(tree):
            for name in self._names(node, package):
                found.add(PrivateUse(self.path, node.lineno, name))
        return found

    def _names(self, node: ast.AST, package: str) -> list[str]:
        """What ``node`` uses privately (rules 1-5), as reported."""
        if isinstance(node, ast.Import):
            names = []
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in NATIVE_MODULES:
                    names.append(top)
                elif top != package and (dotted := _up_to_private(alias.name)) is not None:
                    names.append(dotted)
            return names
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            top = module.split(".")[0]
            if node.level or top == package:
                return []
            if top in NATIVE_MODULES:
                return [top]
            dotted = (_up_to_private(f"{module}.{alias.name}") for alias in node.names)
            return [d for d in dotted if d is not None]
        if isinstance(node, ast.Attribute) and _private(node.attr):
            return self._attribute(*_chain(node))
        if isinstance(node, ast.Call) and _calls_to(node, ATTRIBUTE_CALLS) and node.args:
            name = _constant_name(node)
            if name is None or not _private(name):
                return []
            target = node.args[0]
            if isinstance(target, ast.Attribute):
                root_expr, names = _chain(target)
                return self._attribute(root_expr, [*names, name])
            return self._attribute(target, [name])
        return []

    def _attribute(self, root_expr: ast.expr, names: list[str]) -> list[str]:
        """Rules 2-4 for the chain ``root_expr.names[0]...``, whose last part is private."""
        if isinstance(root_expr, ast.Name) and root_expr.id in self.bound:
            target = self.bound[root_expr.id]
            dotted = None if target is None else _up_to_private(".".join([target, *names]))
            return [] if dotted is None or dotted in DOCUMENTED_PUBLIC else [dotted]
        name = names[-1]  # a private part before it is judged at its own node
        if name in DOCUMENTED_PUBLIC_ATTRIBUTES:
            return []
        on_self = (
            len(names) == 1 and isinstance(root_expr, ast.Name) and root_expr.id in ("self", "cls")
        )
        if name not in self.defined or (name in self.state_names and not on_self):
            return [f".{name}"]
        return []


@pytest.fixture(scope="module")
def state_names(tmp_path_factory: pytest.TempPathFactory) -> frozenset[str]:
    return library_state_names(tmp_path_factory.mktemp("state"))


def test_no_private_name_of_another_library_is_used_outside_runtime(state_names):
    uses = private_uses(PACKAGE_ROOT, state_names)
    new = [str(u) for u in uses if (u.path, u.name) not in KNOWN_PRIVATE_USES]
    assert not new, (
        "private names of other libraries outside dlrmflow/runtime/ (reach them through a "
        "runtime module that says what it reaches into, its version and its fallback):\n"
        + "\n".join(new)
    )
    gone = sorted(KNOWN_PRIVATE_USES - {(u.path, u.name) for u in uses})
    assert not gone, f"no longer used, delete from KNOWN_PRIVATE_USES: {gone}"


def test_the_instance_state_read_is_the_libraries_own(state_names):
    # Rule 4 reads live instances: the names it must hold, for the scan to mean anything.
    assert {"_parameters", "_buffers", "_modules", "_mmap"} <= state_names


SYNTHETIC = {
    "pkg/__init__.py": "",
    "pkg/helpers.py": """
import os
from collections import namedtuple

_CACHE = {}


def _helper():
    return 1


class Own:
    __slots__ = ("_slot",)
    _class_attribute = 0

    def __init__(self):
        self._mine = 1
        setattr(self, "_set", 2)

    def _method(self):
        return self._mine + self._slot + self._set + self._class_attribute


def fine(other, point):
    os._exit  # documented public
    point._replace(x=1)  # a named tuple's
    other._mine, other._method()  # defined by the package
    _ = __import__("os").__name__, os.__file__  # dunders
    return getattr(other, "_mine")
""",
    "pkg/offenders.py": """
import numpy as np
import torch.distributed._shard.metadata
from torch._dynamo import config
from torch import _C, nn
from torch.distributed.sharded import ShardedTensor as ST


def reach(module, memmap, writer, pages):
    torch._assert_async(None)
    np.lib._x._y  # one use: the first private part
    nn.Module._apply
    ST._init_from_local_shards_and_global_metadata()
    module._parameters["w"] = None
    memmap._mmap
    writer._mine._get_file_writer()  # through an attribute of the package's own
    getattr(torch, "_assert_async")
    hasattr(pages.inner, "_buffers")
""",
    "pkg/native.py": "import ctypes\nfrom cffi import FFI\n",
    "pkg/subclass.py": """
import torch.nn


class Net(torch.nn.Module):
    def __init__(self):
        self._mmap = None  # its own: not the memmap's
        self.register_buffer("_start", None)

    def forward(self, other):
        return self._mmap, self._buffers, other._start  # the second is nn.Module's
""",
    "pkg/sub/__init__.py": "from .. import helpers\nfrom ..helpers import _helper\n",
    "pkg/sub/uses.py": """
from pkg import helpers
import pkg.helpers as h


def own():
    return helpers._helper(), h._CACHE, helpers.Own()._method()
""",
    # The runtime reaches in freely.
    "pkg/runtime/__init__.py": "",
    "pkg/runtime/hook.py": "import ctypes\nimport torch\n\ntorch._assert_async\n",
}


def test_the_scan_finds_every_kind_of_private_use_and_only_those(tmp_path, state_names):
    for name, text in SYNTHETIC.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text.lstrip("\n"))
    found = [str(u) for u in private_uses(tmp_path / "pkg", state_names)]
    assert found == [
        "pkg/native.py:1: ctypes",
        "pkg/native.py:2: cffi",
        "pkg/offenders.py:2: torch.distributed._shard",
        "pkg/offenders.py:3: torch._dynamo",
        "pkg/offenders.py:4: torch._C",
        "pkg/offenders.py:9: torch._assert_async",
        "pkg/offenders.py:10: numpy.lib._x",
        "pkg/offenders.py:11: torch.nn.Module._apply",
        "pkg/offenders.py:12: torch.distributed.sharded.ShardedTensor."
        "_init_from_local_shards_and_global_metadata",
        "pkg/offenders.py:13: ._parameters",
        "pkg/offenders.py:14: ._mmap",
        "pkg/offenders.py:15: ._get_file_writer",
        "pkg/offenders.py:16: torch._assert_async",
        "pkg/offenders.py:17: ._buffers",
        "pkg/subclass.py:10: ._buffers",
    ]


RUNTIME = PACKAGE_ROOT / "runtime"
# Not a piece of another library: the error of a piece that is gone (used by the others).
SHARED = {"__init__", "missing"}


def test_each_runtime_piece_says_its_version_and_fallback_and_has_a_test():
    pieces = sorted(p.stem for p in RUNTIME.glob("*.py") if p.stem not in SHARED)
    assert "gomp" in pieces  # the runtime's modules were found
    package_doc = ast.get_docstring(ast.parse((RUNTIME / "__init__.py").read_text())) or ""
    missing = []
    for piece in pieces:
        doc = ast.get_docstring(ast.parse((RUNTIME / f"{piece}.py").read_text())) or ""
        doc = " ".join(doc.split())  # a phrase may break across lines
        if "written against" not in doc.lower():
            missing.append(f"{piece}: the version it was written against")
        if "fallback" not in doc.lower():
            missing.append(f"{piece}: its fallback")
        if not (REPO / "tests" / "runtime" / f"test_{piece}.py").is_file():
            missing.append(f"{piece}: tests/runtime/test_{piece}.py")
        if f"``{piece}``" not in package_doc:
            missing.append(f"{piece}: a line in dlrmflow/runtime/__init__.py's docstring")
    assert not missing, "runtime pieces lacking:\n" + "\n".join(missing)
