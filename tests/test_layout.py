"""The house's floors (docs/architecture.md): every module imports only modules on its own floor or
below, and no modules import each other in a circle; no module, class or function reaches its size
bound. Read from the source, so a move that breaks one fails here before anyone draws the house."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "proxy"

# Top to bottom. A module is on the floor of the longest entry naming it (a file, or a folder/).
FLOORS: list[list[str]] = [
    ["__main__.py", "cli.py", "supervisor.py"],
    ["keys_command.py"],
    ["check.py"],
    ["server.py"],
    ["app.py", "reload.py"],
    ["http/"],
    ["gateway/"],
    ["service.py"],
    ["fetching.py", "asking.py", "verifying.py"],
    ["upstream_reads.py"],
    ["network_set.py"],
    ["network_parts.py"],
    ["cache/"],
    ["prepared.py"],
    ["streams/"],
    ["network.py"],
    ["chain/"],
    ["upstream/"],
    ["workers/"],
    ["config.py"],
    ["config_files.py", "file_trust.py"],
    ["config_expand.py", "config_numbers.py", "options.py", "option_table.py"],
    ["credits/"],
    ["rpc/", "values.py", "redis_link.py", "redis_topology.py", "metrics.py", "logs.py", "memo.py", "host_names.py"],
    [
        "key_context.py",
        "forwarded.py",
        "via.py",
        "tasks.py",
        "hangup.py",
        "hedging.py",
        "request_ids.py",
        "memory_limit.py",
        "cpus.py",
        "origins.py",
        "held_bytes.py",
        "__init__.py",
    ],
]


def floor_of(relative: str) -> int:
    best, floor = -1, -1
    for index, entries in enumerate(FLOORS):
        for entry in entries:
            if (relative == entry or (entry.endswith("/") and relative.startswith(entry))) and len(entry) > best:
                best, floor = len(entry), index
    assert floor >= 0, f"proxy/{relative} is on no floor of tests/test_layout.py (and docs/architecture.md)"
    return floor


def module_file(dotted: str) -> str | None:
    path = PACKAGE.parent / (dotted.replace(".", "/") + ".py")
    if path.exists():
        return str(path.relative_to(PACKAGE))
    package = PACKAGE.parent / dotted.replace(".", "/") / "__init__.py"
    return str(package.relative_to(PACKAGE)) if package.exists() else None


def imports() -> dict[str, set[str]]:
    """Each module's imports of other proxy modules, every import statement (TYPE_CHECKING ones too)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        relative = str(path.relative_to(PACKAGE))
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("proxy"):
                for alias in node.names:
                    target = module_file(f"{node.module}.{alias.name}") or module_file(node.module)
                    if target is not None:
                        names.add(target)
            elif isinstance(node, ast.Import):
                names.update(t for a in node.names if a.name.startswith("proxy") and (t := module_file(a.name)))
        names.discard(relative)
        found[relative] = names
    return found


def test_no_module_imports_a_module_on_a_higher_floor() -> None:
    climbs = [
        f"proxy/{source} -> proxy/{target}"
        for source, targets in imports().items()
        for target in targets
        if not target.endswith("__init__.py") and floor_of(target) < floor_of(source)
    ]
    assert climbs == []


def test_no_import_circle() -> None:
    graph = imports()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    circles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert circles == []


# The house's bounds: a module, a class or a function past them is split before it grows further.
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 550, 300, 80


def test_no_module_class_or_function_reaches_the_house_bounds() -> None:
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if len(text.splitlines()) >= MODULE_LINES:
            over.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            bound = CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size >= bound:
                    over.append(f"{name}: {node.name} {size} lines")
    assert over == []


# The repository's root: what a clone, a wheel's sdist and an image's build context hold beside the
# folders. A scratch file (an attack's config, a pid, a script's output) committed there is caught here.
ROOT_FILES = {
    ".env.example",
    ".dockerignore",
    ".gitignore",
    "CHANGELOG.md",
    "README.md",
    "mkdocs.yml",
    "pyproject.toml",
}


def test_the_repository_root_holds_only_the_projects_own_files() -> None:
    """Rule (DEVELOPERS: never commit caches or scratch): the root's tracked files are the project's
    (scratch files from outside attacks, a pid and two outputs, had been committed there)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert {path for path in tracked if "/" not in path} == ROOT_FILES
