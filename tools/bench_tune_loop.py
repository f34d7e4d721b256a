"""Does ``--tune speed`` model a decode loop's speed? (issue 48, "time what a loop body really costs")

``--tune speed`` times each converted op alone, runs a model whose loops hold converted
ops whole (the source and the lists' conversion, in turn) to scale what a loop body costs
in the target, and predicts the whole model's speed-up: the source's measured time with
its converted ops' float32 seconds replaced by their seconds in the target, a loop body's
ops and casts once per iteration (the iterations counted in one run of the model). This
script checks that prediction on a greedy decode loop with a KV cache: ``--model decode``,
``amp_rewrite.testing.decode``'s (a ``While`` loop, the cache preallocated, weights read in
the body); ``--model gpt2``, keras_hub's ``GPT2CausalLM.generate_step`` (greedy, random
weights, 4 layers 256 wide; keras_hub must be installed), prompts of 8 tokens.

The timing runs once in this process (``amp_rewrite.calibration.speed.tune_model`` at batch
1 and 8, what ``convert --tune speed --batch-sizes 1,8`` runs; its lines are printed), and
three results are written with ``amp-rewrite convert --target bfloat16``, each with the plan
its model is for: "lists" (the lists alone); "tuned" (the timing's keeps as a ``--lists``
overlay, which reproduces the tuned graph); "between", where nothing calibrated the model
(the op type it finds costliest in float32 kept float32; modeled with just those nodes in
float32). The source and the three are called in turn (rounds, the order rotated) at
batch 1 and 8. For each: the measured speed-up (median over rounds of the source's time /
the result's) and the modeled one, and their ratio; the goal is modeled / measured within 10%.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_tune_loop.py             # a few minutes
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_tune_loop.py --model gpt2 --rounds 7
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_tune_loop.py --smoke     # a tiny loop: checks the script
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BATCHES = (1, 8)


@dataclass(frozen=True)
class Loop:
    """A decode loop to measure: its SavedModel (``save(path)``), its prompts at a batch size."""

    title: str
    save: Callable[[Path], Path]
    feeds: Callable[[int], dict[str, Any]]
    output: str


def decode_loop(smoke: bool, width: int, length: int) -> Loop:
    from amp_rewrite.testing.decode import DecodeShape, save_decode_loop

    shape = DecodeShape(vocab=64, width=16, prompt=2, length=6) if smoke else DecodeShape(
        vocab=512, width=width, prompt=8, length=length)
    rng = np.random.default_rng(0)
    return Loop(f"decode loop: vocab {shape.vocab}, width {shape.width}, prompt {shape.prompt}, {shape.length}"
                f" tokens ({shape.length - 1} iterations)", lambda path: save_decode_loop(path, shape),
                lambda batch: {"token_ids": rng.integers(0, shape.vocab, (batch, shape.prompt)).astype(np.int32)},
                "tokens")


def gpt2(smoke: bool, width: int, length: int) -> Loop:
    """keras_hub's GPT-2 ``generate_step`` as a signature: token ids and padding mask in, token ids out."""
    import keras
    import keras_hub
    import tensorflow as tf

    vocab, layers, prompt = (64, 1, 2) if smoke else (1024, 4, 8)
    width, length = (16, 6) if smoke else (width, length)

    def save(path: Path) -> Path:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocab, num_layers=layers, num_heads=4,
                                                 hidden_dim=width, intermediate_dim=4 * width,
                                                 max_sequence_length=length, dropout=0.0)
        causal_lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        causal_lm.compile(sampler="greedy")
        module = tf.Module()
        module.causal_lm = causal_lm
        module.generate = tf.function(lambda token_ids, padding_mask: {"token_ids": causal_lm.generate_step(
            {"token_ids": token_ids, "padding_mask": padding_mask})["token_ids"]}, input_signature=[
            tf.TensorSpec([None, length], tf.int32, name="token_ids"),
            tf.TensorSpec([None, length], tf.bool, name="padding_mask")], autograph=False)
        tf.saved_model.save(module, str(path), signatures={"serving_default": module.generate})
        return path

    def feeds(batch: int) -> dict[str, Any]:
        token_ids = np.zeros((batch, length), np.int32)
        token_ids[:, :prompt] = np.random.default_rng(0).integers(1, vocab, (batch, prompt))
        return {"token_ids": token_ids, "padding_mask": token_ids > 0}

    return Loop(f"keras_hub GPT2CausalLM.generate_step: vocab {vocab}, {layers} layers {width} wide, prompt {prompt},"
                f" {length} tokens ({length - prompt} iterations)", save, feeds, "token_ids")


MODELS = {"decode": decode_loop, "gpt2": gpt2}


def convert(source: Path, destination: Path, *extra: str) -> str:
    """``amp-rewrite convert --target bfloat16 --keep-failed`` in this process; what it printed.
    Validation may fail (random weights: near-tied logits pick other tokens); the result is
    written all the same, and only its speed matters here."""
    from amp_rewrite import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["convert", str(source), str(destination), "--target", "bfloat16", "--keep-failed", *extra])
    if code not in (0, 1) or not destination.exists():
        raise SystemExit(f"convert {' '.join(extra)} failed: {err.getvalue().strip().splitlines()[-1:]}")
    return out.getvalue() + err.getvalue()


def tuning_of(source: Path, cache: Path, inputs: Path, budget_s: float) -> Any:
    """What ``convert --tune speed --batch-sizes 1,8`` computes (its plan, problem, timings):
    ops timed into ``cache``, loops run whole, in ``budget_s`` seconds."""
    from amp_rewrite.calibration import speed
    from amp_rewrite.calibration.savedmodel import read_model
    from amp_rewrite.core.boundaries import LOOPS
    from amp_rewrite.core.lists import load_lists
    from amp_rewrite.core.target import lookup_target

    model = read_model(source)
    feeds, _ = speed.batch_feeds(model, inputs, BATCHES)
    tuning = speed.tune_model(model, feeds, target="bfloat16", lists=load_lists("bfloat16"),
                              cache=speed.open_cache(cache, lookup_target("bfloat16")), budget_s=budget_s,
                              cross_function=LOOPS)  # convert's default: the graph it writes
    return tuning


def between(tuning: Any, work: Path) -> tuple[Path, set, str]:
    """A plan neither the lists' nor the tuned one, to check the model where it was not
    calibrated: the converted op type the model thinks costliest in float32 at batch 1 kept
    float32 (an overlay for ``--lists``). Returns the overlay, the nodes that rewrite
    converts, and the op type."""
    from dataclasses import replace

    import yaml

    from amp_rewrite.calibration.calibrate import keep_entries, node_items
    from amp_rewrite.calibration.savedmodel import rewrite_model
    from amp_rewrite.core.boundaries import LOOPS
    from amp_rewrite.core.lists import load_lists
    from amp_rewrite.tuning.decide import modeled_seconds

    problem, low = tuning.problem, tuning.target.dtype
    ops = {candidate.op for candidate in problem.candidates.values()}
    by_op = {op: modeled_seconds(replace(problem, tensors={}, candidates={
        node: c for node, c in problem.candidates.items() if c.op == op}), tuning.timings, low, True, 1, set())
        for op in ops}  # each op type's float32 seconds, its casts left out
    op = max(by_op, key=by_op.get)
    keep = {node: f"bench: every {op} kept float32" for node, c in problem.candidates.items() if c.op == op}
    entries = keep_entries(keep, node_items(tuning.model.program, tuning.model.entry_functions))
    overlay = work / "between.yaml"
    overlay.write_text(yaml.safe_dump({"keep_nodes": dict(entries)}))
    result = rewrite_model(tuning.model, target="bfloat16", lists=load_lists("bfloat16").keeping(entries),
                           cross_function=LOOPS)
    converted = {(d.function, d.node) for d in result.report.decisions if d.converted}
    return overlay, converted & set(problem.candidates), op


def modeled_of(tuning: Any, name: str, converted: set, batch: int, source_s: float) -> float:
    """The model's speed-up at ``batch`` for a source of ``source_s`` a call: the lists' or
    the tuned plan's (``Plan.modeled``), or ``converted`` in the target (``between``)."""
    from amp_rewrite.calibration.speed import modeled_speed
    from amp_rewrite.tuning.decide import Plan, modeled_seconds

    plan = tuning.plan
    if name == "between":
        seconds = modeled_seconds(tuning.problem, tuning.timings, tuning.target.dtype, True, batch, converted)
        plan = Plan({}, {batch: (plan.modeled[batch][0], seconds, seconds)})
    return modeled_speed(plan, batch, source_s, tuned=name != "lists") or 1.0


def callers(paths: dict[str, Path], feeds: dict[str, Any], output: str) -> dict[str, Callable[[], Any]]:
    """Each SavedModel's ``serving_default`` on the same prompts, as a call."""
    import tensorflow as tf

    fed = {name: tf.constant(value) for name, value in feeds.items()}
    found = {}
    for name, path in paths.items():
        signature = tf.saved_model.load(str(path)).signatures["serving_default"]
        found[name] = (lambda s: lambda: s(**fed)[output].numpy())(signature)
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
    parser.add_argument("--model", choices=sorted(MODELS), default="decode")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--tune-budget", type=float, default=60.0, help="convert's --tune-budget (seconds)")
    args = parser.parse_args()
    from bench_pass import machine_line

    if args.model == "gpt2" and importlib.util.find_spec("keras_hub") is None:
        print("keras_hub is not installed: --model gpt2 cannot run here", file=sys.stderr)
        return 77
    loop = MODELS[args.model](args.smoke, args.width, args.length)
    rounds = 3 if args.smoke else args.rounds
    print(machine_line())
    print(f"{loop.title}; {rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="bench-tune-loop-") as work:
        work = Path(work)
        paths = {"float32": loop.save(work / "float32")}
        cache, inputs = work / "timings.json", work / "prompts.npz"
        np.savez(inputs, **loop.feeds(1))
        tuning = tuning_of(paths["float32"], cache, inputs, args.tune_budget)
        print("\n".join([tuning.summary(), *[f"Note: {note}" for note in tuning.notes]]))
        (work / "tuned.yaml").write_text(tuning.overlay())
        convert(paths["float32"], work / "lists", "--inputs", str(inputs))
        convert(paths["float32"], work / "tuned", "--inputs", str(inputs), "--lists", str(work / "tuned.yaml"))
        paths.update(lists=work / "lists", tuned=work / "tuned")
        overlay, converted, op = between(tuning, work)
        convert(paths["float32"], work / "between", "--inputs", str(inputs), "--lists", str(overlay))
        paths["between"] = work / "between"
        loops = ", ".join(f"{item} x{count:g}" for item, count in sorted(tuning.problem.repeats.items()))
        print(f"runs per call counted: {loops or 'none'}; between: every {op} kept float32,"
              f" {len(converted)} of {len(tuning.problem.candidates)} converted")
        print("| batch | float32 ms | lists: measured | modeled | modeled/measured | between: measured | modeled"
              " | modeled/measured | tuned: measured | modeled | modeled/measured |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for batch in BATCHES:
            seconds = time_rounds(callers(paths, loop.feeds(batch), loop.output), rounds)
            source = statistics.median(seconds["float32"])
            cells = [str(batch), f"{source * 1e3:.1f}"]
            for name in ("lists", "between", "tuned"):
                measured = statistics.median(a / b for a, b in zip(seconds["float32"], seconds[name]))
                modeled = modeled_of(tuning, name, converted, batch, source)
                cells += [f"{measured:.2f}x", f"{modeled:.2f}x", f"{modeled / measured:.2f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
