"""A deferred module is imported by its first use, once, whatever imported it by name before."""

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from p2p_diloco.net import lazy_imports


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A package ``lazypkg`` whose submodule ``heavy`` counts its own executions in ``lazypkg.RUNS``."""
    root = tmp_path / "lazypkg"
    root.mkdir()
    (root / "__init__.py").write_text("RUNS = []\n")
    (root / "heavy.py").write_text("import time\nimport lazypkg\nlazypkg.RUNS.append(1)\ntime.sleep(0.05)\n"
                                   "def solve(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "lazypkg.heavy"
    for name in ("lazypkg.heavy", "lazypkg"):
        sys.modules.pop(name, None)


def test_import_statement_runs_nothing_and_first_use_runs_the_module_once(package):
    lazy_imports.defer(package)
    import lazypkg
    import lazypkg.heavy  # noqa: F401 - what hivemind's `import scipy.optimize` does

    assert lazypkg.RUNS == []
    assert lazypkg.heavy.solve(3) == 6  # the first attribute read loads it
    assert lazypkg.RUNS == [1]
    from lazypkg.heavy import solve

    assert solve(4) == 8 and lazypkg.RUNS == [1]
    assert not isinstance(sys.modules[package], lazy_imports.Deferred)
    assert not isinstance(lazypkg.heavy, lazy_imports.Deferred)  # the parent's attribute is the real module


def test_threads_that_use_it_together_load_it_once(package):
    lazy_imports.defer(package)
    import lazypkg
    import lazypkg.heavy

    stand_in = lazypkg.heavy
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(stand_in.solve(1))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [2] * 8 and lazypkg.RUNS == [1]


def test_a_module_imported_already_is_left_alone(package):
    import lazypkg.heavy

    lazy_imports.defer(package)
    assert sys.modules[package] is lazypkg.heavy and lazypkg.RUNS == [1]


def test_hivemind_balances_load_through_the_deferred_scipy_optimize():
    """In a fresh interpreter, as a learner starts: importing hivemind loads no scipy.optimize; hivemind's
    load balancing (which calls scipy.optimize.linprog when a peer declares a bandwidth) still works."""
    code = textwrap.dedent("""
        import sys
        from p2p_diloco.net import lazy_imports
        lazy_imports.defer_all()
        import hivemind
        from hivemind.averaging.load_balancing import load_balance_peers
        print(isinstance(sys.modules["scipy.optimize"], lazy_imports.Deferred))
        print(load_balance_peers(100, [1.0, 2.0, None]), load_balance_peers(90, [None, None, None]))
        print(isinstance(sys.modules["scipy.optimize"], lazy_imports.Deferred))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    deferred, balanced, still = out.stdout.split("\n")[:3]
    assert deferred == "True" and still == "False"
    assert balanced == "(0, 69, 31) (30, 30, 30)"
