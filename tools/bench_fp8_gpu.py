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

Anywhere else (a CPU, an older GPU) it prints one line saying why it does not run, and exits 0.
``--smoke`` runs the same code on the CPU with tiny models, to check the script itself (no
FP8 GEMMs there: XLA's CPU backend has none).

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_fp8_gpu.py [--runs 20] [--models bert mlp]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MIN_CAPABILITY = (8, 9)
VARIANTS = ("float32", "float16", "float8")
BERT = {"layers": 12, "width": 768, "heads": 12, "ff_width": 3072, "seq_len": 128, "batch": 32}
MLP = {"layers": 4, "width": 4096, "batch": 8192}
SMOKE = {"bert": {"layers": 1, "width": 64, "heads": 4, "ff_width": 128, "seq_len": 16, "batch": 4},
         "mlp": {"layers": 2, "width": 64, "batch": 16}}
FP8_GEMM = "__cublas$lt$matmul$f8"
GEMMS = ("__cublas$lt$matmul", "__cublas$gemm")


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=("bert", "mlp"), default=["bert", "mlp"])
    parser.add_argument("--runs", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--dump", type=Path, default=Path("fp8_hlo"), help="where optimized HLO goes")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks this script only")
    args = parser.parse_args()
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
                for _ in range(3):  # compile and warm up
                    function(x)[0].numpy()
            times: dict[str, list[float]] = {key: [] for key in functions}
            for round_ in range(args.runs):
                order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]
                for key in order:
                    start = time.perf_counter()
                    function = functions[key]
                    function(x)[0].numpy()
                    times[key].append(time.perf_counter() - start)
        base = statistics.median(times["float32"])
        for key in VARIANTS:
            median = statistics.median(times[key])
            print(f"| {name} | {key} | {counts[key][0]} | {counts[key][1]} | {median * 1e3:.2f} | {base / median:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
