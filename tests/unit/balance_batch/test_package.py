"""The library's shape, read from its source with ``ast``: rooms a reader takes in at once (no function over 60
lines, no class over 200, docstrings not counted), one place that turns a planner's name into its function (the
registry), and ``PLANNERS`` the library's own two, the peers the harness measures registered apart."""

import ast
from pathlib import Path

import balance_batch
from balance_batch import PLANNERS
from balance_batch.planners import planner_names

PACKAGE = Path(balance_batch.__file__).parent
MAX_FUNCTION, MAX_CLASS = 60, 200


def _docstring_lines(node) -> int:
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].end_lineno - body[0].lineno + 1
    return 0


def code_lines(node) -> int:
    """``node``'s lines less its docstring (a class: its methods' and nested classes' docstrings too)."""
    lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
    if isinstance(node, ast.ClassDef):
        lines -= sum(_docstring_lines(n) for n in ast.walk(node)
                     if n is not node and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return lines


def oversized(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        limit = MAX_CLASS if isinstance(node, ast.ClassDef) else \
            MAX_FUNCTION if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if limit is not None and code_lines(node) > limit:
            found.append(f"{node.name}: {code_lines(node)} lines")
    return found


def test_no_function_over_60_lines_and_no_class_over_200():
    found = {p.relative_to(PACKAGE).as_posix(): big for p in sorted(PACKAGE.rglob("*.py"))
             if (big := oversized(p.read_text()))}
    assert not found, f"split these by meaning (docstrings not counted): {found}"


def test_the_measure_counts_code_not_docstrings():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION - 1))
    doc = '    """' + "\n" * 30 + '    """\n'
    assert oversized(f"def f():\n{doc}{body}\n") == []  # 60 lines of code, a long docstring
    assert oversized(f"def f():\n{body}\n    y = 0\n") == ["f: 61 lines"]


def test_one_place_turns_a_planner_name_into_its_function():
    callers = sorted(p.relative_to(PACKAGE.parent).as_posix() for root in ("balance_batch", "harness", "backends")
                     for p in (PACKAGE.parent / root).rglob("*.py") if "register(Planner(" in p.read_text())
    assert callers == ["balance_batch/planners.py", "harness/peers/__init__.py"]
    for path in PACKAGE.rglob("*.py"):  # no chain of `if planner == "..."` anywhere in the library
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in planner_names()
                                                     for c in node.comparators):
                raise AssertionError(f"{path.name}:{node.lineno} dispatches on a planner's name")


def test_planners_names_the_librarys_own_and_the_peers_register_apart():
    from harness.peers import PEER_NAMES

    assert PLANNERS == ("greedy", "balanced")
    assert not set(PEER_NAMES) & set(PLANNERS)
    assert set(planner_names()) == set(PLANNERS) | set(PEER_NAMES)
