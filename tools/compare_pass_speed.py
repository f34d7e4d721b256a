"""Time this tree's pass against another revision's in one process, their calls interleaved.

``bench_pass.py`` times our pass against grappler's; two runs of it on a shared machine
differ by more than the 5% a refactoring may cost. This tool exports REV with ``git
archive`` into a temporary folder, renames its package ``amp_rewrite_base`` so that both
import side by side, checks on each graph that both give the same GraphDef bytes and the
same decisions, then calls them in turn, alternating which goes first, and prints the
median wall and CPU time of each, the ratios of medians and the ratio of the best CPU
times. The CPU time (the process's) moves less than the wall time when other work shares
the machine, and the best of many the least.

Graphs: ``bench_pass.py``'s training steps, or with ``--sizes`` its MatMul chains of
those node counts (bfloat16).

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/compare_pass_speed.py REV [--rounds 40] [--sizes 5000,20000]

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
from collections.abc import Callable, Iterator, Sequence
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's package, whatever is installed
sys.path.insert(0, str(ROOT / "tools"))

SMOKE_SIZE, SMOKE_ROUNDS = 300, 2


def export_renamed(revision: str, directory: Path) -> None:
    """``git archive REV`` into ``directory``, package renamed ``amp_rewrite_base``."""
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    (directory / "amp_rewrite").rename(directory / "amp_rewrite_base")
    for path in (directory / "amp_rewrite_base").rglob("*.py"):
        path.write_text(re.sub(r"\bamp_rewrite\b", "amp_rewrite_base", path.read_text(encoding="utf-8")),
                        encoding="utf-8")


def graphs(sizes: Sequence[int]) -> Iterator[tuple[str, object, list[str], tuple[str, ...]]]:
    """(label, GraphDef, fetches, targets) of each graph to time."""
    import bench_pass
    from amp_rewrite.testing.models import build_model_graph

    if sizes:
        for size in sizes:
            yield f"MatMul chain, {size:,} nodes", bench_pass.matmul_chain(size), ["Identity"], (bench_pass.CHAIN_TARGET,)
        return
    for label, name, build_args in bench_pass.GRAPHS:
        model = build_model_graph(name, training=True, **build_args)
        yield label, model.graph_def, list(model.fetches), tuple(bench_pass.TARGETS)


def timed(run: Callable[[], object], wall: list[float], cpu: list[float]) -> None:
    start, start_cpu = time.perf_counter(), time.process_time()
    run()
    wall.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)


def same_rewrite(old: object, new: object) -> bool:
    return old.graph_def.SerializeToString(deterministic=True) == new.graph_def.SerializeToString(
        deterministic=True) and [tuple(d) for d in old.report.decisions] == [tuple(d) for d in new.report.decisions]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision", nargs="?", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--rounds", type=int, default=40, help="timed calls of each pass per graph (default 40)")
    parser.add_argument("--sizes", default="", help="MatMul chains of these node counts instead of the training steps")
    parser.add_argument("--smoke", action="store_true", help=f"one {SMOKE_SIZE}-node chain, {SMOKE_ROUNDS} rounds")
    args = parser.parse_args(argv)
    sizes = [SMOKE_SIZE] if args.smoke else [int(size) for size in args.sizes.split(",") if size.strip()]
    rounds = SMOKE_ROUNDS if args.smoke else args.rounds
    with tempfile.TemporaryDirectory(prefix="amp_base_") as folder:
        export_renamed(args.revision, Path(folder))
        sys.path.insert(0, folder)
        base = importlib.import_module("amp_rewrite_base")
        import amp_rewrite

        print(f"base: {args.revision}; new: {ROOT} (working tree); {rounds} calls each, alternating\n")
        print("| graph | target | base wall (s) | new wall (s) | new/base wall | base CPU (s) | new CPU (s) |"
              " new/base CPU | new/base best CPU |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for label, graph_def, fetches, targets in graphs(sizes):
            for target in targets:
                passes = {which: (lambda module=module: module.rewrite_graph_def(graph_def, target=target,
                                                                                 fetches=fetches))
                          for which, module in (("base", base), ("new", amp_rewrite))}
                if not same_rewrite(passes["base"](), passes["new"]()):
                    print(f"{label}, {target}: the two revisions rewrite differently", file=sys.stderr)
                    return 1
                wall: dict[str, list[float]] = {"base": [], "new": []}
                cpu: dict[str, list[float]] = {"base": [], "new": []}
                for round_ in range(rounds):
                    for which in ("base", "new") if round_ % 2 == 0 else ("new", "base"):
                        timed(passes[which], wall[which], cpu[which])
                w = {which: statistics.median(values) for which, values in wall.items()}
                c = {which: statistics.median(values) for which, values in cpu.items()}
                print(f"| {label} | {target} | {w['base']:.4f} | {w['new']:.4f} | {w['new'] / w['base']:.3f} |"
                      f" {c['base']:.4f} | {c['new']:.4f} | {c['new'] / c['base']:.3f} |"
                      f" {min(cpu['new']) / min(cpu['base']):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
