"""The house rules a reader relies on: comments say why, not when; the README stays a front page."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_dated_or_tracker_lines_in_the_package():
    pattern = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bissue \d+\b")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "p2p_diloco").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_readme_is_a_front_page_with_the_two_commands_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    commands = [i for i, line in enumerate(lines) if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 2 and commands[1] < 20
    assert lines[commands[0]].endswith("p2p-diloco swarm") and lines[commands[1]].endswith(".venv/bin/pytest")


def test_the_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.endswith(".venv/bin/pytest"))
    assert command in (ROOT / ".ci" / "run").read_text()


def test_docs_link_nowhere_outside_the_repository():
    found = []
    for p in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\]\(([^)#\s]+)", p.read_text()):
            if not m.group(1).startswith("http") and not (p.parent / m.group(1)).exists():
                found.append(f"{p.name}: {m.group(1)}")
        found += [f"{p.name}: {m.group(0)}" for m in re.finditer(r"\.\./shared|\bissue \d+", p.read_text())]
    assert not found, found
