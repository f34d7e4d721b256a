"""Does ``--tune speed`` model a decode loop's speed? (issue 48, "time what a loop body really costs")

``--tune speed`` times each converted op alone and predicts the whole model's speed-up
from those times: the source's measured time with its converted ops' float32 seconds
replaced by their seconds in the target, a loop body's ops and casts once per iteration
(the iterations counted in one run of the model). This script checks that prediction on a
greedy decode loop with a KV cache (``amp_rewrite.testing.decode``: a ``While`` loop,
the cache preallocated, weights read in the body), converted to bfloat16 twice:

* ``amp-rewrite convert --target bfloat16`` (the lists alone);
* ``amp-rewrite convert --target bfloat16 --tune speed --batch-sizes 1,8``.

Then the timing's plan is read back from the cache that convert filled (nothing timed
again), and the source and both results are called in turn (rounds, the order rotated)
at batch 1 and 8 in this one process. For each result: the measured speed-up (median over
rounds of the source's time / the result's) and the modeled one, and their ratio; the goal
is modeled / measured within 10%.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_tune_loop.py             # a few minutes
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_tune_loop.py --smoke     # a tiny loop: checks the script
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BATCHES = (1, 8)


def convert(source: Path, destination: Path, *extra: str) -> str:
    """``amp-rewrite convert --target bfloat16`` in this process; its stdout (it must succeed)."""
    from amp_rewrite import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["convert", str(source), str(destination), "--target", "bfloat16", *extra])
    if code != 0:
        raise SystemExit(f"convert {' '.join(extra)} failed: {err.getvalue().strip().splitlines()[-1:]}")
    return out.getvalue() + err.getvalue()


def plan_of(source: Path, cache: Path) -> Any:
    """The plan ``--tune speed --batch-sizes 1,8`` made, from its cache (nothing timed again)."""
    from amp_rewrite.calibration import speed
    from amp_rewrite.calibration.savedmodel import read_model
    from amp_rewrite.core.lists import load_lists
    from amp_rewrite.core.target import lookup_target

    model = read_model(source)
    feeds, _ = speed.batch_feeds(model, None, BATCHES)
    tuning = speed.tune_model(model, feeds, target="bfloat16", lists=load_lists("bfloat16"),
                              cache=speed.open_cache(cache, lookup_target("bfloat16")))
    if tuning.timings.timed:
        print(f"note: {tuning.timings.timed} op(s) were not in the cache and were timed again", file=sys.stderr)
    return tuning.plan, tuning.problem


def callers(paths: dict[str, Path], batch: int, prompt: int, vocab: int) -> dict[str, Callable[[], Any]]:
    """Each SavedModel's ``serving_default`` on the same token ids, as a call."""
    import numpy as np
    import tensorflow as tf

    ids = tf.constant(np.random.default_rng(0).integers(0, vocab, (batch, prompt)).astype(np.int32))
    found = {}
    for name, path in paths.items():
        signature = tf.saved_model.load(str(path)).signatures["serving_default"]
        found[name] = (lambda s: lambda: s(token_ids=ids)["tokens"].numpy())(signature)
    return found


def time_rounds(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each, ``rounds`` rounds, the order rotated each round, after a warm-up call."""
    for call in calls.values():
        call()
    names = list(calls)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            start = time.perf_counter()
            calls[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny loop, 3 rounds: checks the script")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args()
    from bench_pass import machine_line

    from amp_rewrite.calibration.speed import modeled_speed
    from amp_rewrite.testing.decode import DecodeShape, save_decode_loop

    shape = DecodeShape(vocab=64, width=16, prompt=2, length=6) if args.smoke else DecodeShape(
        vocab=512, width=args.width, prompt=8, length=args.length)
    rounds = 3 if args.smoke else args.rounds
    print(machine_line())
    print(f"decode loop: vocab {shape.vocab}, width {shape.width}, prompt {shape.prompt}, {shape.length} tokens"
          f" ({shape.length - 1} iterations); {rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="bench-tune-loop-") as work:
        work = Path(work)
        paths = {"float32": save_decode_loop(work / "float32", shape)}
        cache = work / "timings.json"
        convert(paths["float32"], work / "lists")
        said = convert(paths["float32"], work / "tuned", "--tune", "speed", "--batch-sizes", "1,8",
                       "--tune-cache", str(cache), "--tune-budget", "60")
        paths.update(lists=work / "lists", tuned=work / "tuned")
        print("\n".join(line for line in said.splitlines() if line.startswith(("Timing:", "Speed against", "Note:"))))
        plan, problem = plan_of(paths["float32"], cache)
        loops = ", ".join(f"{item} x{count:g}" for item, count in sorted(problem.repeats.items()))
        print(f"runs per call counted: {loops or 'none'}")
        print("| batch | float32 ms | lists: measured | lists: modeled | modeled/measured"
              " | tuned: measured | tuned: modeled | modeled/measured |")
        print("|---|---|---|---|---|---|---|---|")
        for batch in BATCHES:
            seconds = time_rounds(callers(paths, batch, shape.prompt, shape.vocab), rounds)
            source = statistics.median(seconds["float32"])
            cells = [str(batch), f"{source * 1e3:.1f}"]
            for name, tuned in (("lists", False), ("tuned", True)):
                measured = statistics.median(a / b for a, b in zip(seconds["float32"], seconds[name]))
                modeled = modeled_speed(plan, batch, source, tuned) or 1.0
                cells += [f"{measured:.2f}x", f"{modeled:.2f}x", f"{modeled / measured:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
