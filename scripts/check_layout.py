"""The codebase's layout rules, checked by `make lint` (and so by CI):

- a Python file past LONG lines is named as a warning, never a failure: code is cut at its seams, not at a
  line count (a file past ~800 lines is a smell to look at, STYLE.md);
- tests mirror the packages: a folder under tests/ is a package's folder (tests/serving/router for
  serving/router), and a test named after a module of a subpackage lives in that subpackage's folder
  (tests/serving/router/test_policy.py, not tests/serving/test_policy.py);
- no import cycle among the packages' modules: every import counts, inside functions too, and so does
  `import_module("...")` or `__import__("...")` of a literal name (only those under `if TYPE_CHECKING:`
  do not), so dependencies point one way;
- and between packages, down LAYERS alone: experiments -> serving -> engine -> transfer -> pdkernels (a
  package imports only those after it: the serving runtime never imports the main job or the simulator,
  the engine never imports the runtime, the transfer layer never imports the engine);
- no worker role compared by its name (`role == "prefill"`): a role is an `engine.role.Role`, and what
  differs between roles is one of its traits (`role.sends_kv`, `role.samples`, ...).

python scripts/check_layout.py [ROOT]; exits 1 with one line per breach (warnings: exit 0).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LONG = 800
SOURCES = ("engine", "serving", "experiments", "transfer", "pdkernels", "scripts", "tests")
PACKAGES = ("engine", "serving", "experiments", "transfer", "pdkernels")  # no import circle among these
LAYERS = ("experiments", "serving", "engine", "transfer", "pdkernels")  # each imports only those after it


def long_files(root: Path) -> list[str]:
    """Warnings: the files past LONG lines."""
    out = []
    for top in SOURCES:
        for path in sorted((root / top).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > LONG:
                out.append(f"warning: {path.relative_to(root)}: {n} lines (past {LONG}: look for a seam)")
    return out


def _modules(package: Path) -> set[str]:
    return {p.stem for p in package.glob("*.py")} | {
        p.name for p in package.iterdir() if (p / "__init__.py").exists()
    }


def misplaced_tests(root: Path) -> list[str]:
    out = []
    tests = root / "tests"
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests)
        package = root / folder
        if folder.parts and not package.is_dir():
            out.append(
                f"{path.relative_to(root)}: tests/{folder} mirrors no package ({folder} does not exist)"
            )
            continue
        name = path.stem.removeprefix("test_")
        if any(name == m or name.startswith(m + "_") for m in _modules(package)):
            continue  # named after a module here (or a behaviour of none: test_chaos_soak)
        for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").exists()):
            hits = [m for m in _modules(sub) if name == m or name.startswith(m + "_")]
            if hits:
                where = sub.relative_to(root)
                out.append(f"{path.relative_to(root)}: tests {where}/{hits[0]}.py: belongs in tests/{where}/")
    return out


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The project modules module `name` imports (`from pkg import mod` counts as mod, not pkg)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    named = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            named |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        elif isinstance(node, ast.Call) and _dynamic_import(node):
            named.add(node.args[0].value)
    out = set()
    for target in named:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def _dynamic_import(call: ast.Call) -> bool:
    """import_module("x"), importlib.import_module("x") or __import__("x"), of a literal name."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    literal = (
        bool(call.args) and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
    )
    return name in ("import_module", "__import__") and literal


def _graph(root: Path) -> dict[str, set[str]]:
    """Each of the packages' modules -> the project modules it imports."""
    paths = {}
    for top in PACKAGES:
        for path in (root / top).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: _imports(name, path, set(paths)) for name, path in paths.items()}


def upward_imports(root: Path, graph: dict[str, set[str]] | None = None) -> list[str]:
    """Each import from a package into one at or above it in LAYERS (its own excepted)."""
    out = []
    for name, targets in sorted((graph or _graph(root)).items()):
        top = name.split(".")[0]
        below = LAYERS[LAYERS.index(top) + 1 :]
        for target in sorted(targets):
            if target.split(".")[0] not in (top, *below):
                out.append(f"{name} imports {target}: {top} may import only {', '.join(below) or 'itself'}")
    return out


def import_cycles(root: Path, graph: dict[str, set[str]] | None = None) -> list[str]:
    """Each group of modules that import each other, round a circle (Tarjan's strongly connected
    components of the import graph)."""
    graph = graph or _graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(f"an import cycle: {', '.join(sorted(group))}")

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


ROLE_NAMES = {"prefill", "decode", "colocated"}


def role_names(root: Path) -> list[str]:
    """Each comparison of something named role with a role's name (==, !=, in, not in a tuple of names)."""
    out = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                named = any(
                    isinstance(n, ast.Constant)
                    and n.value in ROLE_NAMES
                    or isinstance(n, ast.Tuple | ast.List | ast.Set)
                    and any(isinstance(e, ast.Constant) and e.value in ROLE_NAMES for e in n.elts)
                    for n in sides
                )
                if named and any("role" in ast.unparse(n) for n in sides):
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    out.append(f"{where}: a role compared by name ({ast.unparse(node)}): use its Role")
    return out


def main(root: Path) -> int:
    graph = _graph(root)  # the costly part (every module parsed and walked): made once
    breaches = (
        misplaced_tests(root) + import_cycles(root, graph) + upward_imports(root, graph) + role_names(root)
    )
    for line in long_files(root) + breaches:
        print(line)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
