"""Does ``--tune speed``'s cache help a bfloat16 training step? (issue 37, training part)

The live rewrite (``amp_rewrite.mixed_precision``, ``enable_mixed_precision_graph_rewrite``)
converts a training step as the lists say; given ``timing_cache=``, each trace also keeps
float32 what the cache says runs slower in the target, timing nothing on the step's path.
This script times the step's ops once, offline, into a cache (as ``convert --tune speed``
does), then traces three copies of one training step, a custom loop as TensorFlow's
"training loop from scratch" guide writes it (GradientTape, a Keras optimizer), and times
them in turn on the same batches:

* float32 (no rewrite);
* ``mixed_precision(target="bfloat16")``: the lists alone;
* ``mixed_precision(target="bfloat16", timing_cache=FILE)``: the lists and the cache.

Speed-up = median over rounds of float32's step time / the variant's. Model: MobileNetV2
(``keras.applications``, weights=None, 10 classes) at 96x96, batch 16.

    TF_CPP_MIN_LOG_LEVEL=2 nice -n 10 .venv/bin/python tools/bench_live_tuning.py   # a few minutes
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_live_tuning.py --smoke     # tiny CNN: checks the script

"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(smoke: bool) -> tuple[Any, Any, Any]:
    """The model, its optimizer and one batch."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    size, batch = (32, 4) if smoke else (96, 16)
    if smoke:
        model = keras.Sequential([keras.Input((size, size, 3)), keras.layers.Conv2D(8, 3, activation="relu6"),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    else:
        model = keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3), classes=10,
                                               classifier_activation=None)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")
    return model, keras.optimizers.SGD(0.01), (x, y)


def make_step(model: Any, optimizer: Any) -> Any:
    import keras
    import tensorflow as tf

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss
    return step


def step_graph(step: Any, batch: tuple[Any, Any], variables: list[Any]) -> tuple[Any, dict, dict, list[str]]:
    """The float32 step's graph: its GraphDef, the input placeholders' shapes, the captured
    variables' handles (placeholder -> dtype, shape) and the outputs to keep."""
    concrete = step.get_concrete_function(*batch)
    graph = concrete.graph
    feeds = {t.op.name: tuple(t.shape.as_list()) for t in graph.inputs if t.dtype.name != "resource"}
    import tensorflow as tf

    by_handle = {id(v.handle): v for v in variables}
    handles = {internal.op.name: (tf.as_dtype(by_handle[id(external)].dtype).as_datatype_enum,
                                  tuple(by_handle[id(external)].shape))
               for external, internal in graph.captures if id(external) in by_handle}
    return graph.as_graph_def(), feeds, handles, [t.op.name for t in graph.outputs]


def offline_timing(graph_def: Any, feeds: dict, handles: dict, fetches: list[str], cache_path: Path,
                   budget_s: float) -> str:
    """Time the step's converted ops into the cache at ``cache_path`` (offline); what it cost."""
    from amp_rewrite.calibration.speed import save_cache
    from amp_rewrite.core.rewrite import rewrite_graph_def
    from amp_rewrite.core.target import BFLOAT16
    from amp_rewrite.tuning.cache import load_cache
    from amp_rewrite.tuning.decide import plan_rewrite
    from amp_rewrite.tuning.shapes import infer_shapes
    from amp_rewrite.tuning.timing import Budget

    base = rewrite_graph_def(graph_def, target="bfloat16", fetches=fetches)
    cache = load_cache(cache_path)
    budget = Budget(budget_s)
    shapes = infer_shapes(graph_def, feeds, handles=handles)
    batch = next(iter(feeds.values()))[0]
    problem, timings, plan = plan_rewrite(graph_def, base, BFLOAT16, {batch: shapes}, cache, budget)
    save_cache(cache)
    return (f"{timings.timed} op(s) timed in {budget.spent():.1f} s, {timings.skipped} left by the {budget_s:g} s"
            f" budget; the plan keeps {len(plan.keep)} of {len(problem.candidates)} converted node(s) float32")


def time_steps(steps: dict[str, Any], batch: tuple[Any, Any], rounds: int) -> dict[str, list[float]]:
    """Each step called in turn, the order rotated per round, after two warm-up calls each."""
    for step in steps.values():
        for _ in range(2):
            step(*batch).numpy()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for index in range(rounds):
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            start = time.perf_counter()
            steps[name](*batch).numpy()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny CNN, 2 rounds: checks the script")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=30.0, help="seconds for the offline timing")
    args = parser.parse_args(argv)
    import tensorflow as tf

    import amp_rewrite

    model, optimizer, batch = build(args.smoke)
    tensors = tuple(tf.constant(a) for a in batch)
    float32 = make_step(model, optimizer)
    float32(*tensors)  # builds the optimizer's variables
    steps = {"float32": float32}
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-live-tuning-") as directory:
        cache = Path(directory) / "timings.json"
        graph_def, feeds, handles, fetches = step_graph(float32, tensors, model.variables + optimizer.variables)
        cost = offline_timing(graph_def, feeds, handles, fetches, cache, 2.0 if args.smoke else args.budget)
        for name, options in (("bfloat16 (lists)", {}), ("bfloat16 (lists + timing_cache)", {"timing_cache": cache})):
            with amp_rewrite.mixed_precision(target="bfloat16", **options):
                steps[name] = make_step(model, optimizer)
                steps[name].get_concrete_function(*tensors)
    seconds = time_steps(steps, tensors, 2 if args.smoke else args.rounds)
    print(f"Offline timing: {cost}")
    for name, times in seconds.items():
        ratio = statistics.median(a / b for a, b in zip(seconds["float32"], times))
        print(f"| {name} | {statistics.median(times) * 1e3:,.1f} ms | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
