"""Print amp_rewrite's module import graph by layer, from the source (no module is imported).

Layers, lowest first: the ground floor (``_quiet``, ``_tf``, ``errors``: they import
nothing of the package, and any layer may use them), ``core`` (the pass), ``tuning``
(timing ops, on ``core``), then ``training``, ``calibration`` (models on disk, validation,
statistics, calibration, the model-level timing) and ``testing``, which build on those two
and not on each other, then ``cli`` (the command, which may use them all), then the package
facade (``amp_rewrite/__init__.py``, ``__main__.py``). An import that points to a higher
layer or to a sibling layer runs upward; the tool lists each one, and any import cycle, and
exits 1 if there is either. Imports under ``if TYPE_CHECKING:`` and inside functions count too.

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
# The flat layout before sub-packages: where each module would sit.
FLAT_MODULE_TO_LAYER = {
    **dict.fromkeys(("_quiet", "_tf", "errors"), "base"),
    **dict.fromkeys(("graph_io", "support", "typegraph", "lists", "functions", "colouring", "casts",
                     "boundaries", "report", "rewrite"), "core"),
    **dict.fromkeys(("live", "optimizers"), "training"),
    **dict.fromkeys(("savedmodel", "validate", "dump", "cli"), "cli"),
    **dict.fromkeys(("reference", "models", "loops"), "testing"),
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "facade"
    if len(parts) > 2 or parts[1] in LAYER_RANK:  # amp_rewrite.<layer>[.<module>]
        return parts[1]
    return FLAT_MODULE_TO_LAYER.get(parts[1], "core")


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
    return 1 if upward or cycles else 0


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
