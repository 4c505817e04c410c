"""The DiLoCo math imports no networking: in a fresh interpreter, importing the math modules (and the
no-network benchmark built on them) leaves hivemind out of ``sys.modules``."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATH = ["outer", "merging", "fragments", "grace", "round", "quantization", "averaging", "served", "learner_state",
        "lr_schedule", "inner_optim", "model"]


def _imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    return set(out.stdout.split())


def test_the_math_modules_import_without_hivemind():
    modules = _imported_after("\n".join(f"import p2p_diloco.{m}" for m in MATH))
    assert "torch" in modules and f"p2p_diloco.{MATH[0]}" in modules
    assert not {m for m in modules if m == "hivemind" or m.startswith("hivemind.")}


def test_the_no_network_benchmark_imports_without_hivemind():
    modules = _imported_after(
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('diloco_math', 'benchmarks/diloco_math.py')\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))"
    )
    assert "p2p_diloco.outer" in modules and "hivemind" not in modules
