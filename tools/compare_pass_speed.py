"""Time this tree's pass against another revision's in one process, their calls interleaved.

``bench_pass.py`` times our pass against grappler's; two runs of it on a shared machine
differ by more than the 5% a refactoring may cost. This tool exports REV with ``git
archive`` into a temporary folder, renames its package ``amp_rewrite_base`` so that both
import side by side, checks on ``bench_pass.py``'s training-step graphs that both give
the same GraphDef bytes and the same decisions, then calls them in turn, alternating
which goes first, and prints the median and best time of each and the ratio of medians.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/compare_pass_speed.py REV [--rounds 40]

Exits 1 when the two revisions disagree on a graph.
"""
from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's package, whatever is installed

GRAPHS = (
    ("ResNet50 training step, 224x224", "resnet50", {"image_size": 224}),
    ("transformer training step", "transformer", {}),
)
TARGETS = ("float16", "bfloat16")


def export_renamed(revision: str, directory: Path) -> None:
    """``git archive REV`` into ``directory``, package renamed ``amp_rewrite_base``."""
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    (directory / "amp_rewrite").rename(directory / "amp_rewrite_base")
    for path in (directory / "amp_rewrite_base").rglob("*.py"):
        path.write_text(re.sub(r"\bamp_rewrite\b", "amp_rewrite_base", path.read_text(encoding="utf-8")),
                        encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision", help="the git revision to compare with, e.g. main or a commit")
    parser.add_argument("--rounds", type=int, default=40, help="timed calls of each pass per graph (default 40)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="amp_base_") as folder:
        export_renamed(args.revision, Path(folder))
        sys.path.insert(0, folder)
        base = importlib.import_module("amp_rewrite_base")
        import amp_rewrite
        from amp_rewrite.testing.models import build_model_graph

        print(f"base: {args.revision}; new: {ROOT} (working tree); {args.rounds} calls each, alternating\n")
        print("| graph | target | base median (s) | new median (s) | new/base | base best (s) | new best (s) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for label, name, build_args in GRAPHS:
            model = build_model_graph(name, training=True, **build_args)
            for target in TARGETS:
                passes = {
                    which: (lambda module=module: module.rewrite_graph_def(model.graph_def, target=target,
                                                                           fetches=model.fetches))
                    for which, module in (("base", base), ("new", amp_rewrite))
                }
                old, new = passes["base"](), passes["new"]()
                if old.graph_def.SerializeToString(deterministic=True) != new.graph_def.SerializeToString(
                    deterministic=True
                ) or [tuple(d) for d in old.report.decisions] != [tuple(d) for d in new.report.decisions]:
                    print(f"{label}, {target}: the two revisions rewrite differently", file=sys.stderr)
                    return 1
                times: dict[str, list[float]] = {"base": [], "new": []}
                for round_ in range(args.rounds):
                    for which in ("base", "new") if round_ % 2 == 0 else ("new", "base"):
                        start = time.perf_counter()
                        passes[which]()
                        times[which].append(time.perf_counter() - start)
                medians = {which: statistics.median(values) for which, values in times.items()}
                print(f"| {label} | {target} | {medians['base']:.4f} | {medians['new']:.4f} | "
                      f"{medians['new'] / medians['base']:.3f} | {min(times['base']):.4f} | {min(times['new']):.4f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
