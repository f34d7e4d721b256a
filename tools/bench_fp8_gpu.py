"""GPU check of the float8 target: do XLA's FP8 GEMMs appear, and how fast is it?

On an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper) this builds a BERT-base encoder
(12 layers, width 768, 12 heads, feed-forward 3072) and a large MLP (4 x Dense 4096), with
random weights held in variables as a SavedModel holds them. It takes amax from two
calibration batches, rewrites to float16 and to float8 with ``rewrite_graph_def``, and runs
float32, float16 (ours) and float8 (ours) each as one ``tf.function(jit_compile=True)``. For
each it prints the count of cuBLASLt FP8 GEMMs (``__cublas$lt$matmul$f8`` custom calls) and
other GEMMs in XLA's optimized HLO, the median step time, and the speed-up over float32
measured in the same run, variants timed in turn round by round. Optimized HLO is written
under ``--dump`` (default ``fp8_hlo/``).

Training rows (``--train-models``, default BERT-base with a 2-class head, sequence 128,
batch 32, and ResNet50 at 224x224, batch 64): one ``tf.function(jit_compile=True)``
training step (tape, gradients, SGD's ``apply``; ``amp_rewrite.testing.digits.training_step``)
as our bfloat16 rewrite, as our FP8 training (``target="float8"``) and as Keras'
``QuantizedFloat8DTypePolicy`` (``model.quantize("float8")`` on ``mixed_bfloat16``: Dense and
EinsumDense only), with the FP8 GEMMs and FP8 convolutions (``__cudnn$convForwardGraph``) in
XLA's optimized HLO, the median step time and the speed-up over bfloat16 in the same run.

Anywhere else (a CPU, an older GPU) it prints one line saying why it does not run, and exits 0.
``--smoke`` runs the same code on the CPU with tiny models (a two-convolution CNN in
ResNet50's place), to check the script itself (no FP8 GEMMs there: XLA's CPU backend has none):
the inference rows unless ``--train-models`` names some (their XLA compiles take minutes on
a CPU), HLO under a temporary directory unless ``--dump`` says where; before TensorFlow
2.18 (no float8) it says why and exits 77.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_fp8_gpu.py [--runs 20] [--models bert mlp]
        [--train-models bert resnet50]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from amp_rewrite.core.float8 import inference as float8  # noqa: E402

MIN_CAPABILITY = (8, 9)
VARIANTS = ("float32", "float16", "float8")
BERT = {"layers": 12, "width": 768, "heads": 12, "ff_width": 3072, "seq_len": 128, "batch": 32}
MLP = {"layers": 4, "width": 4096, "batch": 8192}
SMOKE = {"bert": {"layers": 1, "width": 64, "heads": 4, "ff_width": 128, "seq_len": 16, "batch": 4},
         "mlp": {"layers": 2, "width": 64, "batch": 16}}
FP8_GEMM = "__cublas$lt$matmul$f8"
GEMMS = ("__cublas$lt$matmul", "__cublas$gemm")
FP8_CONV = "__cudnn$convForwardGraph"  # XLA's cuDNN graph convolution, which its FP8 convolutions become
TRAIN_VARIANTS = ("bfloat16", "float8", "keras-float8")
RESNET = {"size": 224, "batch": 64}
SMOKE_RESNET = {"size": 8, "batch": 4}


def skip_reason() -> str | None:
    """Why FP8 GEMMs cannot run here, or None."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "no GPU visible to TensorFlow"
    details = tf.config.experimental.get_device_details(gpus[0])
    capability = tuple(details.get("compute_capability") or (0, 0))
    if capability < MIN_CAPABILITY:
        return (f"{details.get('device_name', 'the GPU')} has compute capability {capability[0]}.{capability[1]},"
                f" below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}")
    return None


def build(name: str, smoke: bool) -> tuple[Any, tf.TensorSpec, np.ndarray]:
    """The Keras model, its input spec and a sample batch (seeded)."""
    import keras

    mlp, bert = (SMOKE["mlp"], SMOKE["bert"]) if smoke else (MLP, BERT)

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    layers = keras.layers
    if name == "mlp":
        inputs = keras.Input((mlp["width"],))
        hidden = inputs
        for _ in range(mlp["layers"]):
            hidden = layers.Dense(mlp["width"], activation="relu")(hidden)
        x = rng.standard_normal((mlp["batch"], mlp["width"])).astype(np.float32)
        return keras.Model(inputs, hidden), tf.TensorSpec(x.shape, tf.float32, name="x"), x
    spec = bert
    inputs = keras.Input((spec["seq_len"], spec["width"]))
    hidden = inputs
    for _ in range(spec["layers"]):
        attention = layers.MultiHeadAttention(spec["heads"], key_dim=spec["width"] // spec["heads"])(hidden, hidden)
        hidden = layers.LayerNormalization()(hidden + attention)
        feed_forward = layers.Dense(spec["ff_width"], activation="gelu")(hidden)
        hidden = layers.LayerNormalization()(hidden + layers.Dense(spec["width"])(feed_forward))
    x = rng.standard_normal((spec["batch"], spec["seq_len"], spec["width"])).astype(np.float32)
    return keras.Model(inputs, hidden), tf.TensorSpec(x.shape, tf.float32, name="x"), x


def variants(name: str, smoke: bool, device: str) -> tuple[dict[str, Any], np.ndarray]:
    """One jit-compiled function per variant, and a sample batch."""
    from amp_rewrite import rewrite_graph_def
    from amp_rewrite.testing.float8 import tensor_amax, xla_function
    from amp_rewrite.testing.models import captured_variables

    model, spec, x = build(name, smoke)
    concrete = tf.function(lambda inputs: model(inputs, training=False)).get_concrete_function(spec)
    graph_def = concrete.graph.as_graph_def()
    fetches = [tensor.op.name for tensor in concrete.graph.outputs]
    variables = {tensor: v.numpy() for tensor, v in captured_variables(concrete, model.variables).items()}
    calibration = [{"x:0": np.random.default_rng(seed).standard_normal(x.shape).astype(np.float32)}
                   for seed in (1, 2)]
    amax = tensor_amax(graph_def, calibration, variables)
    graphs = {
        "float32": graph_def,
        "float16": rewrite_graph_def(graph_def, target="float16", fetches=fetches).graph_def,
        "float8": rewrite_graph_def(graph_def, target="float8", fetches=fetches, amax=amax).graph_def,
    }
    with tf.device(device):
        return {key: xla_function(g, ["x:0"], fetches, variables) for key, g in graphs.items()}, x


def training_model(name: str, smoke: bool) -> tuple[Any, np.ndarray, np.ndarray]:
    """The Keras model to train (logits out) and one batch of inputs and integer labels (seeded)."""
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    layers = keras.layers
    if name == "bert":
        encoder, _, x = build("bert", smoke)
        model = keras.Model(encoder.input, layers.Dense(2)(layers.GlobalAveragePooling1D()(encoder.output)))
        return model, x, rng.integers(0, 2, len(x)).astype(np.int32)
    spec = SMOKE_RESNET if smoke else RESNET
    x = rng.standard_normal((spec["batch"], spec["size"], spec["size"], 3)).astype(np.float32)
    if smoke:
        inputs = keras.Input(x.shape[1:])
        hidden = layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
        hidden = layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(hidden)
        model = keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(hidden)))
    else:
        model = keras.applications.ResNet50(weights=None, input_shape=x.shape[1:], classes=1000,
                                            classifier_activation=None)
    return model, x, rng.integers(0, 10 if smoke else 1000, len(x)).astype(np.int32)


def training_steps(name: str, smoke: bool, device: str, dump: Path) -> tuple[dict[str, Any], tuple, dict]:
    """One jit-compiled training step per variant (traced and compiled under it), the batch, and
    each variant's (FP8 GEMMs, FP8 convolutions, other GEMMs) in XLA's optimized HLO."""
    import keras

    from amp_rewrite.testing.digits import training_step, variant_settings

    steps, counts = {}, {}
    for variant in TRAIN_VARIANTS:
        keras.backend.clear_session()
        with variant_settings(variant, optimizer=keras.optimizers.SGD(0.01)) as optimizer, tf.device(device):
            model, x, y = training_model(name, smoke)
            if variant == "keras-float8":
                model.quantize("float8")
            step = training_step(model, optimizer)
            batch = (tf.constant(x), tf.constant(y))
            hlo = step.experimental_get_compiler_ir(*batch)(stage="optimized_hlo")
            step(*batch).numpy()  # traced and compiled here, with the variant on
        (dump / f"train-{name}-{variant}.txt").write_text(hlo)
        counts[variant] = (hlo.count(f'"{FP8_GEMM}"'), hlo.count(f'"{FP8_CONV}"'),
                           sum(hlo.count(f'"{gemm}"') for gemm in GEMMS))
        steps[variant] = step
    return steps, batch, counts


def timed_rounds(functions: dict[str, Any], args: tuple, runs: int, device: str) -> dict[str, float]:
    """Median seconds per call of each function, called in turn round by round (the order
    rotating), after three warm-up calls each (the first compiles)."""
    keys = list(functions)
    call = lambda key: tf.nest.flatten(functions[key](*args))[0].numpy()
    times: dict[str, list[float]] = {key: [] for key in keys}
    with tf.device(device):
        for key in keys:
            for _ in range(3):
                call(key)
        for round_ in range(runs):
            for key in keys[round_ % len(keys):] + keys[:round_ % len(keys)]:
                start = time.perf_counter()
                call(key)
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


CANNOT_RUN = 77  # --smoke's exit status where this TensorFlow has no float8 (tests/test_tools.py skips)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", choices=("bert", "mlp"), default=["bert", "mlp"])
    parser.add_argument("--train-models", nargs="*", choices=("bert", "resnet50"),
                        help="training rows (none: inference only; default bert resnet50, none with --smoke)")
    parser.add_argument("--runs", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--dump", type=Path, help="where optimized HLO goes (default fp8_hlo/; --smoke: a temporary"
                                                  " directory)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks this script only")
    args = parser.parse_args(argv)
    if args.train_models is None:
        args.train_models = [] if args.smoke else ["bert", "resnet50"]
    if args.smoke and tuple(int(part) for part in tf.__version__.split(".")[:2]) < float8.MIN_TENSORFLOW:
        print(f"bench_fp8_gpu: float8 needs TensorFlow {'.'.join(map(str, float8.MIN_TENSORFLOW))}+;"
              f" this is {tf.__version__}", file=sys.stderr)
        return CANNOT_RUN
    if args.dump is None and args.smoke:
        with tempfile.TemporaryDirectory(prefix="amp-rewrite-fp8-hlo-") as directory:
            args.dump = Path(directory)
            return run(args)
    args.dump = args.dump or Path("fp8_hlo")
    return run(args)


def run(args: argparse.Namespace) -> int:
    device = "/CPU:0" if args.smoke else "/GPU:0"
    reason = None if args.smoke else skip_reason()
    if reason is not None:
        print(f"bench_fp8_gpu: skipped: {reason}; FP8 GEMMs need compute capability 8.9+ and CUDA 12")
        return 0
    if not args.smoke:
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
        print(f"GPU: {details.get('device_name')} (compute capability {details.get('compute_capability')});"
              f" TensorFlow {tf.__version__}")
    args.dump.mkdir(parents=True, exist_ok=True)
    if args.models:
        print("| model | variant | FP8 GEMMs | other GEMMs | median ms | speed-up vs float32 |")
        print("|---|---|---:|---:|---:|---:|")
    for name in args.models:
        functions, x = variants(name, args.smoke, device)
        with tf.device(device):
            x = tf.constant(x)
            counts = {}
            for key, function in functions.items():
                hlo = function.experimental_get_compiler_ir(x)(stage="optimized_hlo")
                (args.dump / f"{name}-{key}.txt").write_text(hlo)
                fp8 = hlo.count(f'"{FP8_GEMM}"')
                counts[key] = (fp8, sum(hlo.count(f'"{gemm}"') for gemm in GEMMS))
        medians = timed_rounds(functions, (x,), args.runs, device)
        for key in VARIANTS:
            print(f"| {name} | {key} | {counts[key][0]} | {counts[key][1]} | {medians[key] * 1e3:.2f} |"
                  f" {medians['float32'] / medians[key]:.2f}x |")
    if args.train_models:
        print("\n| training step | variant | FP8 GEMMs | FP8 convolutions | other GEMMs | median ms |"
              " speed-up vs bfloat16 |")
        print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.train_models:
        steps, batch, counts = training_steps(name, args.smoke, device, args.dump)
        medians = timed_rounds(steps, batch, args.runs, device)
        for key in TRAIN_VARIANTS:
            print(f"| {name} | {key} | {' | '.join(map(str, counts[key]))} | {medians[key] * 1e3:.2f} |"
                  f" {medians['bfloat16'] / medians[key]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
