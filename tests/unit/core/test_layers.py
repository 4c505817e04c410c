"""The layers of the package, checked from each module's own imports (``ast``, nothing imported).

``core/`` (the DiLoCo math) imports only the base modules and itself: no hivemind, no
``torch.distributed``, no other subpackage. Across the package, a subpackage imports only those
below it in :data:`LAYERS`, so each folder says which layer its modules belong to.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "p2p_diloco"
# p2p_diloco/<name>.py that every layer may import ("__init__": the names the package itself defines)
BASE = {"config", "errors", "peer_log", "hooks", "__init__"}
# Lowest first: a module may import its own subpackage, the base and any subpackage before its own.
LAYERS = ["core", "trust", "train", "net", "learner", "ops", "sim"]
ENTRY = {"cli", "bootstrap", "__main__", "__init__"}  # top-level commands: may import anything


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (absolute names), with its line; at any depth (lazy imports too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]  # `from p2p_diloco import x`
    return out


def _where(name: str) -> str | None:
    """The layer (subpackage or base module) of an imported name of this package; None if not ours."""
    parts = name.split(".")
    if parts[0] != "p2p_diloco" or len(parts) < 2:
        return None
    if not (PACKAGE / f"{parts[1]}.py").exists() and not (PACKAGE / parts[1]).is_dir():
        return "__init__"  # a name the package's __init__ defines (its version, its start time)
    return parts[1]


def _modules(sub: str | None = None) -> list[Path]:
    root = PACKAGE / sub if sub else PACKAGE
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_core_imports_no_network_and_no_other_subpackage():
    found = []
    for path in _modules("core"):
        for line, name in _imports(path):
            ours = _where(name)
            if (name == "hivemind" or name.startswith(("hivemind.", "torch.distributed"))
                    or (ours is not None and ours not in BASE | {"core"} and name != "p2p_diloco")):
                found.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert not found, "\n".join(found)
    assert len(_modules("core")) >= 14  # the walk found the folder


@pytest.mark.parametrize("layer", LAYERS)
def test_a_subpackage_imports_only_the_layers_below_it(layer):
    allowed = BASE | set(LAYERS[: LAYERS.index(layer) + 1])
    found = []
    for path in _modules(layer):
        for line, name in _imports(path):
            ours = _where(name)
            if ours is not None and ours not in allowed and not (ours in LAYERS and name.count(".") == 1
                                                                  and ours == layer):
                found.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert not found, "\n".join(found)


def test_the_base_modules_import_no_subpackage():
    found = []
    for stem in sorted(BASE - {"__init__"}):
        path = PACKAGE / f"{stem}.py"
        for line, name in _imports(path):
            ours = _where(name)
            if ours is not None and ours not in BASE:
                found.append(f"{stem}.py:{line} imports {name}")
    assert not found, "\n".join(found)


def test_every_module_lies_in_a_layer():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert top <= BASE | ENTRY, top - BASE - ENTRY  # nothing else at the top
    assert folders == set(LAYERS), folders ^ set(LAYERS)
    for folder in LAYERS:  # each folder maps its modules in its docstring
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        for path in (PACKAGE / folder).glob("*.py"):
            if path.stem != "__init__":
                assert f".{path.stem}`" in doc, f"{folder}/__init__.py does not mention {path.stem}"
