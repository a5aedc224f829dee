"""The layers hold: imports point down the table (docs/architecture.md shows the same), no
module uses another module's _private names, and no two modules import each other, not even
through an import inside a function. "base" is the modules beside hpdl/cli.py
(config, atomic_file, output_files, formatting, cli_error, rank_exit, settings_table, __init__)."""

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpdl"
ALLOWED = {  # each layer and the layers it may import, besides its own
    "cli": {"bench", "launch", "profile", "sr", "comm", "base"},
    "bench": {"sr", "launch", "torch", "profile", "engine", "comm", "base"},  # engine: its public event stream (halo traffic)
    "sr": {"torch", "comm", "base"},
    "spark": {"launch", "comm", "base"},
    "ray": {"launch", "torch", "engine", "comm", "base"},
    "launch": {"comm", "base"},
    "torch": {"profile", "engine", "comm", "base"},
    "profile": {"engine", "base"},
    "engine": {"comm", "base"},
    "comm": {"base"},
    "base": set(),
}
PUBLIC = {"_fields", "_asdict", "_replace", "_make"}  # underscored, and public where they come from (namedtuple)


def _layer(module):
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return "cli" if parts[-1] in ("cli", "__main__") else "base"


def _is_module(module):
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name):
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__") and name not in PUBLIC


def _violations(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    me = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
    modules = {}  # a local name -> the hpdl module bound to it
    for node in nodes:
        imported = [(a.name, None, a.asname) for a in node.names] if isinstance(node, ast.Import) else (
            [(node.module, a.name, a.asname or a.name) for a in node.names] if isinstance(node, ast.ImportFrom) else [])
        for module, name, local in (i for i in imported if i[0] and i[0].split(".")[0] == "hpdl"):
            target = f"{module}.{name}" if name and _is_module(f"{module}.{name}") else module
            if _private(name) and target != me:
                yield f"{me} imports {module}.{name}"
            if _layer(target) not in ALLOWED[_layer(me)] | {_layer(me)}:
                yield f"{me} ({_layer(me)}) imports {target} ({_layer(target)})"
            if local and _is_module(target) and (name is None or target.endswith(f".{name}")):
                modules[local] = target
    for node in nodes:
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in modules and _private(node.attr):
            if modules[node.value.id] != me:
                yield f"{me} uses {modules[node.value.id]}.{node.attr}"
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1 and _private(getattr(node.args[1], "value", None))
                and getattr(node.args[0], "id", None) not in ("self", "cls")):
            yield f"{me} reaches {ast.unparse(node.args[0])}.{node.args[1].value} by {node.func.id}"


def test_imports_point_down_the_table_and_no_module_uses_another_modules_private_names():
    found = sorted({v for path in PACKAGE.rglob("*.py") for v in _violations(path)})
    assert not found, "\n".join(found)


def _imported_modules(path):
    """``(module, line)`` for every hpdl module that ``path`` imports, at the top or inside a function."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "hpdl")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hpdl":
            for a in node.names:
                yield (f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module), node.lineno


def _circle(edges, start):
    """The shortest path of imports from ``start`` back to ``start``, or None."""
    seen, todo = set(), collections.deque([(start, [start])])
    while todo:
        module, path = todo.popleft()
        for target in edges.get(module, ()):
            if target == start:
                return path + [start]
            if target not in seen:
                seen.add(target)
                todo.append((target, path + [target]))
    return None


def test_no_modules_import_each_other_even_inside_functions():
    # An import moved into a function hides a circle from Python's import but not from the
    # design: the lower module should be handed what it needs (a hook, use_runtime) or the
    # shared part should move into a module of its own, beneath both (object_ops.py).
    edges, lines = {}, {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        me = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for target, line in _imported_modules(path):
            if target != me:
                edges.setdefault(me, set()).add(target)
                lines.setdefault((me, target), f"{path.relative_to(PACKAGE.parent)}:{line}")
    circles = {tuple(sorted(set(c))): c for c in (_circle(edges, m) for m in sorted(edges)) if c}
    assert not circles, "\n".join(" -> ".join(f"{a} ({lines[a, b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
                                  for c in circles.values())
