"""The code as a linter and a reader see it: ruff clean, and no comment that points at an issue number.

ruff's rules and exclusions are in pyproject.toml ([tool.ruff]); ruff itself is in the `test` extra, so a
missing ruff fails here rather than passing unchecked.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Where code, configuration and build files live; README.md and docs/ may speak of issues (they are prose),
# and this file, whose examples are what it looks for.
SOURCE_DIRS = ("backends", "balance_batch", "harness", "hydra_plugins", "reports", "scripts", "sweeps", "tests", ".ci")
SOURCE_FILES = ("Makefile", "pyproject.toml")
SOURCE_SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".ini"}
# "issue 38", "issues 22 and 23", "Issue #7", "(#38 item 10)": a number a reader of the code cannot look up.
# (A colour such as "#444444" has more digits than an issue number.)
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\s*\d+|(?<![\w&#/])#\d{1,4}\b", re.IGNORECASE)


def test_ruff_check_is_clean():
    assert importlib.util.find_spec("ruff") is not None, (
        "ruff is not installed: it is in the test extra (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff check found problems (rules in pyproject.toml):\n{proc.stdout}{proc.stderr}"


def _source_files() -> list[Path]:
    files = [REPO / name for name in SOURCE_FILES]
    for folder in SOURCE_DIRS:
        files += [p for p in (REPO / folder).rglob("*")
                  if p.is_file() and (p.suffix in SOURCE_SUFFIXES or folder == ".ci") and "__pycache__" not in p.parts]
    return sorted(files)


def issue_references(text: str) -> list[tuple[int, str]]:
    """(line number, line) for each line that names an issue by its number."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if ISSUE_NUMBER.search(line)]


def test_the_issue_pattern_finds_what_it_should_and_nothing_else():
    found = issue_references("x = 1  # fixed in issue 38\n# see #12 item 3\n'''Issues 22: text'''\n"
                             "colours = ('#1f77b4', '#444444')\n# a 2 GB cap, 4 ranks, mtpm=4096, item 3\n")
    assert [n for n, _ in found] == [1, 2, 3]


def test_no_comment_points_at_an_issue_number():
    files = _source_files()
    assert any(p.name == "app.py" for p in files) and any(p.suffix == ".yaml" for p in files)  # the walk finds code
    found = [f"{p.relative_to(REPO)}:{n}: {line}" for p in files if p != Path(__file__).resolve()
             for n, line in issue_references(p.read_text())]
    assert not found, ("say the fact itself, not the issue it came from (a reader of the code cannot look it up):\n"
                       + "\n".join(found))
