"""Light commands stay light: help, config errors and ``regions --emit-compose`` load neither torch
nor hivemind (seconds of start-up each), and the codec math imports without hivemind."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "hivemind")

# Runs the CLI in a fresh interpreter, then reports on stderr's last line which heavy packages it loaded.
CLI = """
import sys
from p2p_diloco.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # argparse's --help
    code = e.code
print("loaded:" + ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""

IMPORT = """
import sys
import {modules}
print("loaded:" + ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""

LIGHT = ("--help", "bootstrap --help", "learner --help", "swarm --help", "regions --help", "regions --emit-compose",
         "audit verify --help")
BAD_CONFIG = (
    "learner --set inner.lr=abc",
    "learner --config missing.toml",
    "bootstrap --config missing.toml",
    "swarm --learners 0",
    "learner --fault nonsense",
)


def _cli(command: str) -> list[str]:
    return ["-c", CLI.format(heavy=HEAVY), *command.split()]


def _imports(*modules: str) -> list[str]:
    return ["-c", IMPORT.format(modules=", ".join(modules), heavy=HEAVY)]


# name -> (interpreter arguments, exit code, packages it must not load)
SCRIPTS = {
    **{cmd: (_cli(cmd), 0, HEAVY) for cmd in LIGHT},
    **{cmd: (_cli(cmd), 2, HEAVY) for cmd in BAD_CONFIG},
    "import cli": (_imports("p2p_diloco.cli", "p2p_diloco.bootstrap", "p2p_diloco.errors"), 0, HEAVY),
    "import quantization": (_imports("p2p_diloco.core.quantization"), 0, ("hivemind",)),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    """Every script at once, each in its own interpreter (about 3 s in all on 2 idle cores)."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, (args, _, _) in SCRIPTS.items()
    }
    done = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=60)
            done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_light_work_loads_no_heavy_package(runs: dict[str, subprocess.CompletedProcess], name: str) -> None:
    run, (_, code, forbidden) = runs[name], SCRIPTS[name]
    assert run.returncode == code, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("loaded:"), run.stderr
    assert not set(last.removeprefix("loaded:").split(",")) & set(forbidden), f"{name}: {last}"
    if code == 2:  # a user error: one line, no traceback
        assert run.stderr.startswith("error: ") and len(run.stderr.strip().splitlines()) == 2, run.stderr
