"""Print amp_rewrite's module import graph by layer, from the source (no module is imported).

Layers, lowest first: the ground floor (``_quiet``, ``_tf``, ``errors``: they import
nothing of the package, and any layer may use them), ``core`` (the pass), ``tuning``
(timing ops, on ``core``), then ``training``, ``calibration`` (models on disk, validation,
statistics, calibration, the model-level timing) and ``testing``, which build on those two
and not on each other, then ``cli`` (the command, which may use them all), then the package
facade (``amp_rewrite/__init__.py``, ``__main__.py``). An import that points to a higher
layer or to a sibling layer runs upward; the tool lists each one, and any import cycle, and
exits 1 if there is either. Imports under ``if TYPE_CHECKING:`` and inside functions count too.

It also checks the house rules every module keeps (STYLE 15, 17, 18), and exits 1 on a
breach: no function over 60 lines, none with more than 6 positional parameters, and no
private TensorFlow or Keras module (``tensorflow.python``, ``keras.src``, ...) named outside
``amp_rewrite/_tf.py``, the one door to them.

    python tools/import_graph.py [PACKAGE_DIR]
    python tools/import_graph.py --smoke      # the package, as without arguments (no TensorFlow: fast)
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = "amp_rewrite"
LAYER_RANK = {"base": 0, "core": 1, "tuning": 2, "training": 3, "calibration": 3, "testing": 3, "cli": 4, "facade": 5}
GROUND_FLOOR = ("_quiet", "_tf", "errors")  # modules beside the sub-packages, under every layer
PRIVATE_DOOR = f"{PACKAGE}._tf"  # the one module that may name TensorFlow's and Keras' private modules
PRIVATE_MODULES = ("tensorflow.python", "tensorflow.compiler", "keras.src", "tf_keras.src")
MAX_FUNCTION_LINES = 60      # a function fits on a screen (STYLE 17)
MAX_POSITIONAL_PARAMETERS = 6  # more facts travel as one frozen value (STYLE 18)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "facade"
    if parts[1] in GROUND_FLOOR:
        return "base"
    return parts[1]  # amp_rewrite.<layer>[.<module>]


def imports_of(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports: ``from X import name`` counts X.name when that
    is a module, else X."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(PACKAGE):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            found.add(f"{PACKAGE}.*")  # the facade's lazy names
    found.discard(module)
    return found


def _is_private(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in PRIVATE_MODULES)


def private_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for each private TensorFlow or Keras module a file imports: by an import
    statement, or by ``importlib.import_module`` with the name written out."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if _is_private(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and _is_private(node.module):
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and _is_private(str(node.args[0].value))):
            found.append((node.lineno, node.args[0].value))
    return found


def house_breaches(root: Path, paths: dict[str, Path]) -> list[str]:
    """``path:line what`` for each function over ``MAX_FUNCTION_LINES`` lines (as the line
    numbers of its ``def`` and its last line count them) or with more than
    ``MAX_POSITIONAL_PARAMETERS`` positional parameters (``self`` and ``cls`` aside), and for
    each private TensorFlow or Keras module named outside ``_tf.py``."""
    breaches = []
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        shown = path.relative_to(root.parent)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{shown}:{function.lineno} {function.name}"
            if function.end_lineno - function.lineno >= MAX_FUNCTION_LINES:
                breaches.append(f"{where}: {function.end_lineno - function.lineno + 1} lines; split it into named steps")
            positional = [a.arg for a in function.args.posonlyargs + function.args.args if a.arg not in ("self", "cls")]
            if len(positional) > MAX_POSITIONAL_PARAMETERS:
                breaches.append(f"{where}: {len(positional)} positional parameters; pass one frozen value"
                                " or make the options keyword-only")
        if module != PRIVATE_DOOR:
            breaches += [f"{shown}:{line} imports {name}, a private module; reach it through {PRIVATE_DOOR}"
                         for line, name in private_names(tree)]
    return breaches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path, nargs="?", default=Path(__file__).resolve().parent.parent / PACKAGE,
                        metavar="PACKAGE_DIR", help="default: this checkout's amp_rewrite/")
    parser.add_argument("--smoke", action="store_true", help="the default package: the check make test runs")
    root = parser.parse_args(argv).package
    paths = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    by_layer: dict[str, list[str]] = defaultdict(list)
    upward: list[str] = []
    for module, path in paths.items():
        layer = layer_of(module)
        targets = sorted(t for t in imports_of(path, module, modules) if t != f"{PACKAGE}.*")
        by_layer[layer].append(f"  {module} -> {', '.join(t.removeprefix(PACKAGE + '.') for t in targets) or '-'}")
        for target in targets:
            if target == PACKAGE or target.endswith(".*") or layer == "facade":
                continue
            other = layer_of(target)
            if other != layer and other != "base" and LAYER_RANK[other] >= LAYER_RANK[layer]:
                upward.append(f"  {module} ({layer}) -> {target} ({other})")
    for layer in sorted(by_layer, key=lambda name: (LAYER_RANK[name], name)):
        print(f"[{layer}]")
        print("\n".join(by_layer[layer]))
    print("upward imports:", "none" if not upward else "")
    print("\n".join(upward))
    cycles = find_cycles({m: imports_of(p, m, modules) & modules for m, p in paths.items() if layer_of(m) != "facade"})
    print("import cycles:", "none" if not cycles else "")
    print("\n".join(f"  {' -> '.join(cycle)}" for cycle in cycles))
    breaches = house_breaches(root, paths)
    print("house rules (function size, positional parameters, private TensorFlow modules):",
          "kept" if not breaches else "")
    print("\n".join(f"  {breach}" for breach in breaches))
    return 1 if upward or cycles or breaches else 0


def find_cycles(module_to_imports: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge a depth-first walk finds (package ``__init__`` imports aside)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(module_to_imports.get(module, ())):
            if other not in module_to_imports or other == module.rpartition(".")[0]:
                continue
            if state.get(other) == 1:
                cycles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(module_to_imports):
        if module not in state:
            visit(module, [module])
    return cycles


if __name__ == "__main__":
    sys.exit(main())
