"""The shape of the code, checked from its source with ``ast`` (no imports, no torch).

* No import circles among harness/, backends/, reports/ and hydra_plugins/, and no module
  importing its own package's ``__init__``: a reader can start at any module and follow its
  imports down without coming back. Module-level and function-level imports both count.
* The backend names are written once, in ``backends/registry.py``; every other place reads
  the table. The few uses left are listed in ``ALLOWED_NAME_USES`` with the reason.
* Rooms a reader can take in: no module of harness/ or backends/ over ``MAX_MODULE_LINES``, no function over
  ``MAX_FUNCTION_LINES`` (but the delta-rule scan, kept line-comparable with its upstream), and at most
  ``MAX_TOP_LEVEL`` modules at harness/'s top level: the rest lives in its sub-packages, as backends/'s does.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("balance_batch", "harness", "backends", "reports", "hydra_plugins")
NAMES = ("pytorch", "fsdp2", "megatron_ddp")
REGISTRY = "backends/registry.py"
_ANY = "|".join(NAMES)

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_TOP_LEVEL = 8
# (file, function) -> why it may be longer
LONG_FUNCTIONS: set[tuple[str, str]] = set()

# file -> how often each backend name may appear there as a string of its own, and why.
ALLOWED_NAME_USES = {
    # Each controller class says which backend it is: Backend.name, written to results.json.
    # The registry points at these classes; the class cannot ask the registry who it is.
    "backends/pytorch.py": Counter(pytorch=1),
    "backends/fsdp2.py": Counter(fsdp2=1),
    "backends/megatron_ddp.py": Counter(megatron_ddp=1),
    # BackendSpec's default backend, for code that builds one directly (the CLI names one: harness/conf/backend/).
    "backends/specs.py": Counter(pytorch=1),
}


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages (a package's is its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in the file)."""
    modules = _module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if _is_package(module, modules) else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def test_there_are_no_import_circles():
    graph = import_graph()
    cycles = find_cycles(graph)
    described = [" <-> ".join(c) + "  edges: " + ", ".join(f"{a}->{b}" for a in c for b in sorted(graph[a]) if b in c)
                 for c in cycles]
    assert not cycles, "import circles:\n" + "\n".join(described)


def test_no_module_imports_its_own_package_init():
    graph = import_graph()
    inward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if m.startswith(t + "."))
    assert not inward, "modules importing their own package's __init__:\n" + "\n".join(inward)


def test_the_graph_sees_function_level_and_submodule_imports():
    graph = import_graph()
    assert graph["harness.sweep.hot"] & {"backends", "backends.start"}  # make_backend, imported inside a method
    # "from balance_batch.integrations.transformers import kernels" is the submodule
    assert "balance_batch.integrations.transformers.kernels" in graph["backends.model.step"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _name_uses(path: Path) -> Counter:
    """Backend names in the file's strings: a string that is a name, or a list of two or more names."""
    uses: Counter = Counter()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if node.value in NAMES:
            uses[node.value] += 1
            continue
        if re.search(rf"\b({_ANY})\s*,\s*({_ANY})\b", node.value):
            uses.update(re.findall(rf"\b({_ANY})\b", node.value))
    return uses


def test_the_backend_names_are_written_only_in_the_registry():
    files = [p for package in (*PACKAGES, "scripts") for p in sorted((REPO / package).rglob("*.py"))]
    seen = {}
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        if rel == REGISTRY:
            continue
        uses = _name_uses(path)
        if uses:
            seen[rel] = uses
    unexpected = {rel: dict(uses) for rel, uses in seen.items() if uses != ALLOWED_NAME_USES.get(rel, Counter())}
    gone = sorted(set(ALLOWED_NAME_USES) - set(seen))
    assert not unexpected, f"backend names outside {REGISTRY} (read the registry instead): {unexpected}"
    assert not gone, f"allowed uses no longer there (drop them from ALLOWED_NAME_USES): {gone}"


def test_the_library_and_the_registry_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, balance_batch, harness.peers, backends.registry, harness.app.config, reports.collect; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_the_library_imports_nothing_of_the_harness_or_the_backends():
    """balance_batch is the ground floor: the harness and the backends import it, never the other way round (a
    lengths file's parser was once reached through harness.data.workload)."""
    found = []
    for path in sorted((REPO / "balance_batch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] in ("harness", "backends", "reports", "hydra_plugins")]
    assert not found, f"the library imports the application: {found}"


# The examples docs/library.md points a user of the wheel to: they run beside it, from a copy of examples/.
WHEEL_EXAMPLES = ("dataloader.py", "fsdp2.py", "hf_trainer.py", "tiny.py")


def test_the_library_examples_import_only_the_library_and_its_extras():
    """examples/ beside the library's wheel: no module of the harness, the tests or a package outside the
    ``[transformers]`` extra, and the tiny model is the harness's."""
    allowed = {"balance_batch", "examples", "torch", "transformers", "__future__"}
    found = []
    for name in WHEEL_EXAMPLES:
        path = REPO / "examples" / name
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"examples/{name}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] not in allowed and n.split(".")[0] not in _STDLIB]
    assert not found, f"the examples import what the wheel does not bring: {found}"
    from backends.model.configs import TINY_CONFIG

    tiny = ast.parse((REPO / "examples" / "tiny.py").read_text())  # read, not imported: no torch here
    (config,) = [n.value for n in tiny.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "TINY_CONFIG"]
    assert ast.literal_eval(config) == TINY_CONFIG


_STDLIB = frozenset(__import__("sys").stdlib_module_names)


def test_modules_and_functions_stay_small_and_harness_keeps_to_its_rooms():
    files = [p for package in ("harness", "backends") for p in sorted((REPO / package).rglob("*.py"))]
    long_modules, long_functions, seen = {}, {}, set()
    for path in files:
        rel, text = path.relative_to(REPO).as_posix(), path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                seen.add((rel, node.name))
                if lines > MAX_FUNCTION_LINES and (rel, node.name) not in LONG_FUNCTIONS:
                    long_functions[f"{rel}:{node.name}"] = lines
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines (split them by meaning): {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
    top = sorted(p.name for p in (REPO / "harness").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"harness/ holds {len(top)} modules at its top level: {top}"
    assert LONG_FUNCTIONS <= seen, f"exempt functions no longer there: {sorted(LONG_FUNCTIONS - seen)}"


def test_the_distribution_holds_the_library_alone_with_numpy_its_one_requirement():
    """What pyproject.toml puts in site-packages, found as setuptools finds it: balance_batch and nothing else (the
    harness, backends, reports and sweeper plugin run from the checkout), numpy its one requirement, and every extra
    a lower bound, never a pin, so the wheel installs beside a user's own versions."""
    import tomllib

    from setuptools import find_namespace_packages

    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    found = find_namespace_packages(where=str(REPO), include=doc["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {p.split(".")[0] for p in found} == {"balance_batch"}
    assert "balance_batch.integrations.transformers" in found
    project = doc["project"]
    assert [re.split(r"[<>=!~ ]", r)[0] for r in project["dependencies"]] == ["numpy"]
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    assert extras and all(">=" in r and "==" not in r and "<" not in r for r in extras), extras
    assert (REPO / "harness" / "conf" / "config.yaml").is_file()  # the harness composes its configs from here


# The library's planners and their parts: harness/ and backends/ reach them only through balance_batch.plan_step (and
# define none of their own), so what the harness measures is what the library plans. planned_rows is the pipeline
# beneath plan_step (and the sampler); plan_peer a peer's planner beneath the registry.
PLANNER_PARTS = frozenset({
    "planned_rows", "balanced_schedules", "fewest_padded_microbatches", "make_token_balanced_microbatches",
    "make_fixed_size_microbatches", "greedy_packed_microbatches", "deal_to_ranks", "microbatches_for_rank",
    "lockstep_schedules", "sort_by_length", "length_order", "plan_peer",
})
PLANNER_MODULES = ("balance_batch.balanced", "balance_batch.greedy", "harness.peers.")
# harness/peers/ writes the other frameworks' planners (each registered with the library's registry, then planned
# through plan_step as ours are): the one place beside balance_batch/ that may define a planner.
PEER_PLANNERS = "harness/peers/"
# What a file may use of the parts, and why: a plan given whole (backends/messages.py's given_plan, no planner runs)
# gives lock-step ranks equal counts with lockstep_schedules; Schedule is a type.
ALLOWED = {"backends/messages.py": frozenset({"Schedule", "lockstep_schedules"})}


def planner_uses(path: Path, allowed: frozenset = frozenset()) -> list[str]:
    """Where ``path`` reaches a planner but through plan_step, or defines one: ``line: what`` (``allowed``: names
    it may import and use)."""
    parts = PLANNER_PARTS - allowed
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("balance_batch", "harness.peers")):
            module = node.module
            names = [a.name for a in node.names]
            if module.startswith(PLANNER_MODULES) and module != "harness.peers.common" and not set(names) <= allowed:
                found.append(f"{node.lineno}: from {module} import {', '.join(names)}")
            found += [f"{node.lineno}: imports {n}" for n in names if n in parts]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith(PLANNER_MODULES)]
        elif isinstance(node, ast.Attribute) and node.attr in parts:
            found.append(f"{node.lineno}: uses .{node.attr}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in parts:
            found.append(f"{node.lineno}: defines {node.name}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_the_harness_and_the_backends_plan_only_through_the_librarys_entry_point():
    assert not (REPO / "backends" / "planning").exists()
    files = [p for package in ("harness", "backends") for p in sorted((REPO / package).rglob("*.py"))
             if not p.relative_to(REPO).as_posix().startswith(PEER_PLANNERS)]
    assert (REPO / PEER_PLANNERS / "__init__.py").is_file()  # the exemption names a real folder
    found = {name: uses for path in files
             if (uses := planner_uses(path, ALLOWED.get(name := path.relative_to(REPO).as_posix(), frozenset())))}
    assert not found, f"plan through balance_batch.plan_step, not the planners beneath it: {found}"
    planned = sorted(p.relative_to(REPO).as_posix() for p in files if "plan_step(" in p.read_text())
    assert planned == ["backends/messages.py", "harness/point/setup.py"]  # the ranks' plan, and the harness's


def test_the_planner_scan_finds_each_way_round_it(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("from balance_batch.plan import planned_rows, plan_step\n"
                    "from balance_batch.balanced.packed import x\nimport balance_batch.greedy\n"
                    "import balance_batch.plan as bp\nbp.planned_rows([1], s)\n"
                    "def deal_to_ranks(order, world):\n    return [order]\nfrom harness.peers.common import R\n"
                    "from harness.peers.verl import plan\nfrom harness.peers import PEERS, plan_peer\n"
                    "from balance_batch.greedy import lockstep_schedules\n")
    assert planner_uses(code) == ["1: imports planned_rows", "2: from balance_batch.balanced.packed import x",
                                  "3: import balance_batch.greedy", "5: uses .planned_rows",
                                  "6: defines deal_to_ranks", "9: from harness.peers.verl import plan",
                                  "10: imports plan_peer", "11: from balance_batch.greedy import lockstep_schedules",
                                  "11: imports lockstep_schedules"]
    assert planner_uses(code, frozenset({"lockstep_schedules"}))[-1] == "10: imports plan_peer"  # what a file may use
