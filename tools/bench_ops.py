"""Which elementwise ops run slower in bfloat16 than in float32 on this CPU (``make bench``).

Grappler's bfloat16 infer list converts every elementwise op between two converted ones,
but on a CPU only convolutions and matmuls have oneDNN bfloat16 kernels: the rest are
Eigen kernels that widen each element to float32 and narrow the result again, and for
transcendental functions and activation gradients that costs more than the halved memory
traffic saves. This tool times each elementwise op of the bfloat16 infer list, the ops
of the ``float32`` section of ``lists/bfloat16.yaml`` (taken off that list for this reason),
and ``Exp`` and ``Expm1``, deny ops that are safe where their argument is never positive
(whether converting them pays decides which ``colouring.bounded_ops`` converts there), in
float32 and bfloat16 on two tensor sizes (a BERT-base FFN activation and a ResNet50
stage-3 feature map), as ratios in the same run, and prints a markdown table.

An op belongs in the ``float32`` section when, at both sizes, its bfloat16 kernel takes
longer than its float32 kernel plus two casts (float32 -> bfloat16 of the same tensor):
then keeping it float32 is faster even where it needs a cast on each side. The tool marks
where the YAML and this CPU disagree; it exits 0 either way (the lists are not per-CPU).
Run it on a quiet machine: under load the bfloat16 kernels suffer more than float32's.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_ops.py
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_ops.py --smoke   # every op once on a tiny tensor
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import tensorflow as tf

from amp_rewrite.core.colouring import bounded_ops
from amp_rewrite.core.lists import held_float32, load_lists

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pass  # tools/ is not a package

SHAPES = ((8, 128, 3072), (32, 28, 28, 512))
TIMED_RUNS = 15
WARMUP_RUNS = 3
SMOKE_SHAPES, SMOKE_RUNS = ((2, 8),), 1  # --smoke: checks that every op runs, measures nothing
CAST = "Cast float32->bfloat16"

# Op name -> the op applied to two same-shaped tensors x, y (unary ops use x only;
# inputs are made valid where the op needs it: log of |x| + 1, ...).
Kernel = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
OPS: dict[str, Kernel] = {
    "Add": lambda x, y: tf.raw_ops.Add(x=x, y=y),
    "AddV2": lambda x, y: x + y,
    "BiasAdd": lambda x, y: tf.nn.bias_add(x, y[(0,) * (len(y.shape) - 1)]),
    "Elu": lambda x, y: tf.nn.elu(x),
    "EluGrad": lambda x, y: tf.raw_ops.EluGrad(gradients=x, outputs=y),
    "Erf": lambda x, y: tf.math.erf(x),
    "Erfc": lambda x, y: tf.math.erfc(x),
    "Exp": lambda x, y: tf.exp(x),
    "Expm1": lambda x, y: tf.math.expm1(x),
    "Inv": lambda x, y: tf.raw_ops.Inv(x=x),
    "LeakyRelu": lambda x, y: tf.nn.leaky_relu(x),
    "LeakyReluGrad": lambda x, y: tf.raw_ops.LeakyReluGrad(gradients=x, features=y),
    "Log": lambda x, y: tf.math.log(tf.abs(x) + 1),
    "Log1p": lambda x, y: tf.math.log1p(tf.abs(x)),
    "LogSoftmax": lambda x, y: tf.nn.log_softmax(x),
    "Mean": lambda x, y: tf.reduce_mean(x, -1),
    "Mul": lambda x, y: x * y,
    "RealDiv": lambda x, y: x / (tf.abs(y) + 1),
    "Reciprocal": lambda x, y: tf.math.reciprocal(x),
    "Rsqrt": lambda x, y: tf.math.rsqrt(tf.abs(x) + 1),
    "Selu": lambda x, y: tf.nn.selu(x),
    "SeluGrad": lambda x, y: tf.raw_ops.SeluGrad(gradients=x, outputs=y),
    "Sigmoid": lambda x, y: tf.math.sigmoid(x),
    "SigmoidGrad": lambda x, y: tf.raw_ops.SigmoidGrad(y=x, dy=y),
    "Softmax": lambda x, y: tf.nn.softmax(x),
    "Softplus": lambda x, y: tf.math.softplus(x),
    "SoftplusGrad": lambda x, y: tf.raw_ops.SoftplusGrad(gradients=x, features=y),
    "Softsign": lambda x, y: tf.nn.softsign(x),
    "SoftsignGrad": lambda x, y: tf.raw_ops.SoftsignGrad(gradients=x, features=y),
    "Sqrt": lambda x, y: tf.sqrt(tf.abs(x)),
    "Square": lambda x, y: tf.square(x),
    "SquaredDifference": lambda x, y: tf.math.squared_difference(x, y),
    "Sub": lambda x, y: x - y,
    "Sum": lambda x, y: tf.reduce_sum(x, -1),
    "Tanh": lambda x, y: tf.math.tanh(x),
    "TanhGrad": lambda x, y: tf.raw_ops.TanhGrad(y=x, dy=y),
}


def median_ms(kernel: Kernel, x: tf.Tensor, y: tf.Tensor, runs: tuple[int, int]) -> float:
    function = tf.function(kernel, autograph=False)
    timed, warmup = runs
    (seconds,) = bench_pass.median_seconds(lambda: function(x, y), timed=timed, warmup=warmup)
    return seconds * 1e3


def times_ms(shape: tuple[int, ...], runs: tuple[int, int]) -> dict[str, tuple[float, float]]:
    """Op -> (float32 ms, bfloat16 ms) on tensors of ``shape``, plus the float32->bfloat16 Cast;
    ``runs``: (timed, warm-up) calls."""
    x32, y32 = tf.random.normal(shape, seed=1), tf.random.normal(shape, seed=2)
    x16, y16 = tf.cast(x32, tf.bfloat16), tf.cast(y32, tf.bfloat16)
    times = {name: (median_ms(kernel, x32, y32, runs), median_ms(kernel, x16, y16, runs))
             for name, kernel in OPS.items()}
    cast = median_ms(lambda x, y: tf.cast(x, tf.bfloat16), x32, y32, runs)
    times[CAST] = (cast, cast)
    return times


def pays_to_hold(times: dict[str, tuple[float, float]], op: str) -> bool:
    """True if ``op`` in float32 with a cast on each side beats it in bfloat16."""
    float32, bfloat16 = times[op]
    return bfloat16 > float32 + 2 * times[CAST][0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every op once on a tiny tensor: checks this script only")
    args = parser.parse_args(argv)
    shapes, runs = (SMOKE_SHAPES, (SMOKE_RUNS, 0)) if args.smoke else (SHAPES, (TIMED_RUNS, WARMUP_RUNS))
    lists, held = load_lists("bfloat16", environ={}), held_float32("bfloat16")
    # Kept float32: held ops, and deny ops that stay denied even with a bounded argument.
    kept = held | ((lists.deny & OPS.keys()) - bounded_ops(lists))
    missing = sorted((held | lists.infer | bounded_ops(lists)) - OPS.keys())
    print(bench_pass.machine_line())
    print(f"Median of {runs[0]} calls after {runs[1]} warm-up, ms; ratio = bfloat16 / float32 time; shapes {' and '.join(map(str, shapes))}.")
    print("Pays to hold = at both sizes, bfloat16 time > float32 time + 2 casts; kept float32 = in the"
          " float32 section of lists/bfloat16.yaml, or a deny op the bounded-argument rule leaves denied.\n")
    per_shape = [times_ms(shape, runs) for shape in shapes]
    header = " | ".join(f"{shape} f32 ms | bf16 ms | ratio" for shape in shapes)
    print(f"| op | {header} | pays to hold | kept float32 |")
    print("|---|" + "---:|---:|---:|" * len(shapes) + "---|---|")
    disagree = []
    for name in sorted(per_shape[0], key=lambda op: -per_shape[0][op][1] / per_shape[0][op][0]):
        cells = " | ".join(f"{t[name][0]:.2f} | {t[name][1]:.2f} | {t[name][1] / t[name][0]:.2f}" for t in per_shape)
        if name not in OPS:
            print(f"| {name} | {cells} | | |")
            continue
        pays = all(pays_to_hold(t, name) for t in per_shape)
        if pays != (name in kept):
            disagree.append(name)
        print(f"| {name} | {cells} | {'yes' if pays else 'no'} | {'yes' if name in kept else 'no'} |")
    if missing:
        print(f"\nNot timed (no elementwise form here): {', '.join(missing)}")
    print(f"\nThis CPU and lists/bfloat16.yaml disagree on: {', '.join(disagree) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
