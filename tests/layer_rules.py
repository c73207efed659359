"""The package's import rules, checked from its source: every import counts (module level, inside
functions, under ``TYPE_CHECKING``), since each one is a dependency someone will follow.

The rules (docs/design.md says the same, and tests/test_layers.py checks that it does):

- the layers, in the order each may import: a module imports only its own layer, the layers
  before it in :data:`LAYERS`, and the shared vocabulary (:data:`VOCABULARY`);
- the vocabulary imports only the vocabulary; the package root (``__init__``, ``__main__``) may
  import anything (it is the public API and the entry point);
- ``agent`` travels to the hosts: it imports nothing of the package but its own modules;
- third-party packages stay in their room (:data:`ONLY_IN`), and the pure layers
  (:data:`PURE`) import no asyncio;
- no import circle between modules.

Run against another tree (a copy with a planted fault) through :func:`violations`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LAYERS = (
    "jobs", "machines", "planner", "results", "view", "agent", "transport", "executors", "coordinator", "functions",
    "cli",
)  # fmt: skip
"""Each layer may import the ones before it: what to run, where it may run, decide, what is kept,
what the user sees, what runs on the host, how we reach it, who performs a run, who performs a
batch, Python functions as jobs, the command line."""
VOCABULARY = ("errors", "events")
ROOT = ("__init__", "__main__")
PURE = ("jobs", "machines", "planner")
ONLY_IN = {"asyncssh": ("transport",), "typer": ("cli",), "rich": ("view",)}


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the importing module, dotted, without the package name
    target: str  # what it imports, dotted and absolute ("ssh_scheduler.jobs.needs", "asyncio")
    line: int


def module_names(package: Path) -> dict[str, Path]:
    """``{"jobs.needs": path, "__init__": path, "jobs": path/jobs/__init__.py, ...}``."""
    names: dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports(package: Path) -> Iterator[Import]:
    """Every import statement of every module, resolved to absolute names."""
    name = package.name
    names = module_names(package)
    for module, path in names.items():
        is_package = path.name == "__init__.py"
        here = [name, *module.split(".")] if module != "__init__" else [name]
        if not is_package:
            here = here[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(module, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    # ``from a import b``: the module a.b where b is one, else a itself
                    whole = f"{source}.{alias.name}"
                    inside = whole.split(".", 1)[1] if "." in whole else ""
                    yield Import(module, whole if inside in names else source, node.lineno)


def resolve(target: str, package: str, modules: dict[str, Path]) -> str | None:
    """The module of ours a dotted name lands in (``ssh_scheduler.jobs.needs.Needs`` ->
    ``jobs.needs``), or None for another package."""
    parts = target.split(".")
    if parts[0] != package:
        return None
    parts = parts[1:]
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else "__init__"


def room(module: str) -> str:
    """``jobs.needs`` -> ``jobs``; a root module is its own room."""
    return module.split(".")[0]


def graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports(package):
        found = resolve(imp.target, package.name, modules)
        if found is not None and found != imp.module:
            edges[imp.module].add(found)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative).  A package's
    ``__init__`` that a submodule imports only for being its parent is not counted: ``import
    a.b`` runs ``a/__init__`` but our layer packages' ``__init__`` files import nothing."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def allowed(importer: str, imported: str) -> bool:
    """May module ``importer`` import module ``imported`` (both without the package name)?"""
    source, target = room(importer), room(imported)
    if source in ROOT:
        return True
    if source == "agent":
        return target == "agent"
    if source in VOCABULARY:
        return target in VOCABULARY
    if target in VOCABULARY or target == source:
        return True
    if target in ROOT:
        return False  # the public API is for users; inside, import the defining module
    if source not in LAYERS or target not in LAYERS:
        return False  # a module outside every room is itself a finding
    return LAYERS.index(target) < LAYERS.index(source)


def violations(package: Path) -> list[str]:
    """Every broken rule, one line each (``module:line: what``)."""
    modules = module_names(package)
    found = []
    for module in modules:
        if room(module) not in (*LAYERS, *VOCABULARY, *ROOT):
            found.append(f"{module}: in no layer (put it in one of {', '.join(LAYERS)})")
    for imp in imports(package):
        ours = resolve(imp.target, package.name, modules)
        if ours is not None:
            if ours != imp.module and not allowed(imp.module, ours):
                found.append(f"{imp.module}:{imp.line}: imports {ours} (a {room(ours)} module, not allowed in {room(imp.module)})")
            continue
        top = imp.target.split(".")[0]
        if top in ONLY_IN and room(imp.module) not in ONLY_IN[top]:
            found.append(f"{imp.module}:{imp.line}: imports {top} (only {', '.join(ONLY_IN[top])} may)")
        if top == "asyncio" and room(imp.module) in PURE:
            found.append(f"{imp.module}:{imp.line}: imports asyncio (the {room(imp.module)} layer is pure)")
    for circle in circles(graph(package)):
        found.append(f"import circle: {' <-> '.join(circle)}")
    return sorted(set(found))


def defined_names(path: Path) -> set[str]:
    """Names a module binds at its top level (also inside top-level ``if``/``try``), by
    definition or assignment -- not names it only imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                found.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            body += node.body + node.orelse
            if isinstance(node, ast.Try):
                body += [n for handler in node.handlers for n in handler.body] + node.finalbody
    return found


def name_findings(package: Path) -> list[str]:
    """Names taken from a module that does not define them (a re-export chain), and private
    names (``_x``) used across modules, through ``from m import _x`` or ``m._x``."""
    modules = module_names(package)
    defined = {name: defined_names(path) for name, path in modules.items()}
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        aliases: dict[str, str] = {}  # local name -> our module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                source = resolve(node.module, package.name, modules)
                if source is None or (node.module.split(".", 1)[-1] != source and node.module != package.name):
                    continue
                for alias in node.names:
                    whole = f"{source}.{alias.name}" if source != "__init__" else alias.name
                    if whole in modules:
                        aliases[alias.asname or alias.name] = whole
                        continue
                    if alias.name.startswith("_"):
                        found.append(f"{module}:{node.lineno}: imports the private name {alias.name} of {source}")
                    elif source != "__init__" and alias.name not in defined[source]:
                        found.append(f"{module}:{node.lineno}: imports {alias.name} from {source}, which does not define it")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    ours = resolve(alias.name, package.name, modules)
                    if ours is not None and alias.asname:
                        aliases[alias.asname] = ours
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != module
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{module}:{node.lineno}: uses the private name {node.attr} of {aliases[node.value.id]}")
    return sorted(set(found))
