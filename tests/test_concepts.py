"""docs/concepts.md's one-page design against the code: its layers are the imports' layers (no
module imports one of a layer above it, and the sender and receiver sides import nothing of
each other), every module it names exists, and only the integration layer imports torchrl."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "envsync"
DOC = ROOT / "docs" / "concepts.md"

# the layers of the design, lowest first, as the doc names them
LAYERS: dict[str, set[str]] = {
    "rules": {"protocol", "errors", "state", "indexing", "fitting", "buffers", "shutdown", "stats"}
    | {"configure", "reinit", "levels", "spec"},
    "links": {"links"},
    "core": {"core", "records", "desired", "mirror", "books", "fleet", "history", "pruning"},
    "sender": {"sender", "reads", "acks", "gather", "checkpoint", "restore", "updates", "port", "probe"},
    "receiver": {"receiver", "rows", "env_adapter", "places", "gate", "siblings", "loop", "owner"},
    "integrations": {"integrations", "curriculum", "envs", "demo", "cli", "__main__", "apply", "__init__"},
}
SIDES = ("sender", "receiver")  # one level: neither imports the other


SIDE_FOLDERS = ("sender", "worker")
"""The folders of the two sides: a module in one is named by its own name (``envsync.sender.core``: ``core``)."""


def top(module: str) -> str:
    """The part of ``envsync.<part>...`` a layer is made of (in a side's folder, the module's own name)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in SIDE_FOLDERS:
        return parts[2]
    return parts[1] if len(parts) > 1 else "__init__"


def _resolved(name: str) -> str:
    """``from envsync import name``: a module of the package, or a name its ``__init__`` exports."""
    is_module = (PACKAGE / f"{name}.py").exists() or (PACKAGE / name).is_dir()
    return f"envsync.{name}" if is_module else "envsync"


def imports() -> dict[str, set[str]]:
    """Each module of the package to the envsync modules it imports (type-checking ones too)."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("envsync"):
                base = node.module
                if base == "envsync":
                    found |= {_resolved(a.name) for a in node.names}
                elif base.split(".")[-1] in SIDE_FOLDERS:  # a side's modules, by name
                    found |= {f"{base}.{a.name}" for a in node.names}
                else:
                    found.add(base)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("envsync")}
        out[name] = found
    return out


def layer_of(module: str) -> str:
    part = top(module)
    for name, parts in LAYERS.items():
        if part in parts:
            return name
    raise AssertionError(f"{module} belongs to no layer of the design: add it to the doc and to LAYERS")


def rank(layer: str) -> int:
    order = [name for name in LAYERS if name not in SIDES[1:]]
    return order.index(SIDES[0] if layer in SIDES else layer)


def test_the_docs_layers_are_the_layers_checked_here() -> None:
    line = re.search(r"imports point one way\s*\(([^)]*)\)", DOC.read_text().replace("\n", " "))
    assert line, "docs/concepts.md no longer says which way imports point"
    named = [part.strip() for part in re.split(r"<-|\|", line.group(1).split(":")[0])]
    assert named == list(LAYERS), named


def test_no_module_imports_a_layer_above_its_own_and_the_two_sides_import_nothing_of_each_other() -> None:
    wrong = []
    for module, used in imports().items():
        mine = layer_of(module)
        for other in used:
            theirs = layer_of(other)
            if rank(theirs) > rank(mine) or {mine, theirs} == set(SIDES):
                wrong.append(f"{module} ({mine}) imports {other} ({theirs})")
    assert not wrong, wrong


def test_every_module_the_design_names_exists() -> None:
    design = DOC.read_text().split("## Desired state")[0]
    named = {n for n in re.findall(r"([a-z_/]+\.py)\b", design) if not n.startswith("tests/")}
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    missing = [n for n in named if not any(f == n or f.endswith("/" + n) for f in files)]
    assert named and not missing, missing


def test_only_the_integration_layer_imports_torchrl() -> None:
    outside = []
    for path in PACKAGE.rglob("*.py"):
        if layer_of(".".join(path.relative_to(ROOT).with_suffix("").parts)) == "integrations":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n == "torchrl" or n.startswith("torchrl.") for n in names):
                outside.append(str(path.relative_to(ROOT)))
    assert not outside, outside
