"""The DiLoCo math imports no networking: in a fresh interpreter, importing every module of
``p2p_diloco/core/`` (and the no-network benchmark built on them) leaves hivemind out of ``sys.modules``.
``tests/unit/core/test_layers.py`` checks each module's own imports; this checks what they pull in."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = sorted(f"p2p_diloco.core.{p.stem}" for p in (ROOT / "p2p_diloco" / "core").glob("*.py") if p.stem != "__init__")
# Beside core: the round and the learner's state are written against the averaging interface, not the network.
ALSO = ["p2p_diloco.learner.round", "p2p_diloco.learner.state", "p2p_diloco.train.models.gpt"]


def _imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    return set(out.stdout.split())


def test_the_math_modules_import_without_hivemind():
    modules = _imported_after("\n".join(f"import {m}" for m in CORE + ALSO))
    assert "torch" in modules and set(CORE) <= modules and len(CORE) >= 13
    assert not {m for m in modules if m == "hivemind" or m.startswith("hivemind.")}


def test_the_no_network_benchmark_imports_without_hivemind():
    modules = _imported_after(
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('diloco_math', 'benchmarks/diloco_math.py')\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))"
    )
    assert "p2p_diloco.core.outer" in modules and "hivemind" not in modules
