"""Serving speed of keras_hub backbones through their SavedModel signature (issue 48).

Each backbone (``amp_rewrite.testing.hub``: random weights, no download) is built 4 layers
deep and 256 wide (``FULL``; ResNet with 64 filters per stage), text models on 64 tokens
from a 1000-row table, ViT and ResNet on 224x224 images, and exported as users do
(``model.export``). Variants, all with the same weights:

* float32, the export (the baseline);
* ours: ``amp-rewrite convert --target bfloat16``;
* ours tuned: the same with ``--tune speed --batch-sizes 1,8`` (default budget, a fresh
  timing cache, so its Timing line says what tuning costs);
* Keras' ``mixed_bfloat16`` policy: the backbone built under the policy, float32's weights
  copied in, exported the same way.

The four are loaded in one process and called through ``serving_default`` in turn
(``bench.time_rotated``: one call each per round, the order rotated per round, so load
from other processes falls on all alike), at batch 1 and 8; the ratio is float32's median
time over the variant's, from the same run.

    TF_CPP_MIN_LOG_LEVEL=2 nice -n 10 .venv/bin/python tools/bench_hub_serving.py
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_hub_serving.py --smoke   # tiny: checks the script

The markdown goes to stdout and replaces the ``cpu-bfloat16-hub-serving`` section of
BENCHMARKS.md (``--smoke``: of a copy of it in a temporary directory).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402  (tools/bench.py: the shared timing loop and BENCHMARKS.md's sections)
from bench_decode import load_line  # noqa: E402
from bench_pass import machine_line  # noqa: E402
from bench_serving import benchmark_parser, chosen, convert  # noqa: E402

from amp_rewrite.testing.hub import BACKBONES, IMAGE_BACKBONES, backbone  # noqa: E402

SECTION = "cpu-bfloat16-hub-serving"
SIGNATURE = "serving_default"
BATCHES = (1, 8)
VARIANTS = ("float32", "ours", "ours-tuned", "keras-policy")
LABELS = {"ours": "ours", "ours-tuned": "ours `--tune speed`", "keras-policy": "Keras `mixed_bfloat16`"}
ALL_FLOAT32 = "nothing is converted"  # convert's Speed line where tuning kept every node float32
DEFAULT_MODELS = "gpt2,llama,distil_bert,vit,resnet,gemma,qwen3"


@dataclass(frozen=True)
class Sizes:
    layers: int
    width: int
    resnet_width: int
    vocabulary: int
    sequence: int
    image: int
    rounds: int
    tune_budget: float | None = None  # None: convert's default


FULL = Sizes(layers=4, width=256, resnet_width=32, vocabulary=1000, sequence=64, image=224, rounds=7)
SMOKE = Sizes(layers=1, width=32, resnet_width=16, vocabulary=100, sequence=8, image=32, rounds=1, tune_budget=2)


@dataclass
class ModelRow:
    model: str
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)  # batch -> variant -> median s
    tuned_lines: str = ""
    tune_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def build(name: str, sizes: Sizes, dtype: str | None = None) -> Any:
    width = sizes.resnet_width if name == "resnet" else sizes.width
    return backbone(name, layers=sizes.layers, width=width, vocabulary=sizes.vocabulary,
                    image=(sizes.image, sizes.image, 3), sequence=sizes.sequence, dtype=dtype)


def feeds(signature: Any, sizes: Sizes, batch: int) -> dict[str, np.ndarray]:
    """Inputs of ``batch`` for the signature: images and features normal, masks all ones,
    segment ids 0, token ids within the vocabulary; unknown lengths ``--sequence`` (Whisper's
    encoder frames twice that)."""
    rng = np.random.default_rng(batch)
    drawn = {}
    for name, spec in signature.structured_input_signature[1].items():
        length = 2 * sizes.sequence if name == "encoder_features" else sizes.sequence
        shape = [batch] + [length if d is None else d for d in spec.shape.as_list()[1:]]
        dtype = spec.dtype.as_numpy_dtype
        if spec.dtype.is_floating:
            drawn[name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in name:
            drawn[name] = np.ones(shape, dtype)
        elif "segment" in name:
            drawn[name] = np.zeros(shape, dtype)
        else:
            drawn[name] = rng.integers(0, sizes.vocabulary, shape).astype(dtype)
    return drawn


def named(signature: Any, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` keyed as ``signature`` names its inputs: a one-input Keras model's input is
    named by a session counter (``keras_tensor``, ``keras_tensor_44``), so the policy's
    export names it differently from float32's."""
    names = list(signature.structured_input_signature[1])
    if set(names) == set(given):
        return given
    if len(names) == len(given) == 1:
        return {names[0]: next(iter(given.values()))}
    raise ValueError(f"inputs {sorted(given)} do not match the signature's {sorted(names)}")


def export(name: str, sizes: Sizes, workdir: Path) -> dict[str, Path]:
    """float32's export and the Keras policy's with the same weights."""
    import keras

    keras.utils.set_random_seed(0)
    float32 = build(name, sizes)
    float32.export(str(workdir / f"{name}-float32"), verbose=False)
    policy = build(name, sizes, dtype="mixed_bfloat16")
    policy.set_weights(float32.get_weights())
    policy.export(str(workdir / f"{name}-keras-policy"), verbose=False)
    del float32, policy
    keras.backend.clear_session()
    return {"float32": workdir / f"{name}-float32", "keras-policy": workdir / f"{name}-keras-policy"}


def measure(name: str, sizes: Sizes, workdir: Path, smoke: bool) -> ModelRow:
    row = ModelRow(name)
    dirs = export(name, sizes, workdir)
    signatures = {"float32": tf.saved_model.load(str(dirs["float32"])).signatures[SIGNATURE]}
    inputs = workdir / f"{name}-inputs.npz"
    np.savez(inputs, **feeds(signatures["float32"], sizes, BATCHES[-1]))
    budget = () if sizes.tune_budget is None else ("--tune-budget", f"{sizes.tune_budget:g}")
    extra = {"ours": (), "ours-tuned": ("--tune", "speed", "--batch-sizes", ",".join(map(str, BATCHES)),
                                        "--inputs", str(inputs), "--tune-cache", str(workdir / f"{name}.json"),
                                        *budget)}
    for variant, flags in extra.items():
        dirs[variant] = workdir / f"{name}-{variant}"
        seconds, line = convert(dirs["float32"], dirs[variant], "bfloat16", *flags, in_process=smoke)
        if not line.startswith("ok"):
            row.errors.append(f"{name} convert {variant}: {line or 'no summary'}")
            return row
        if variant == "ours-tuned":
            row.tune_s = seconds
            row.tuned_lines = ". ".join(x.strip().removesuffix(".") for x in line.removeprefix("ok: ").splitlines()
                                        if x.startswith(("Timing:", "Speed")))  # one sentence each
        print(f"{name}: converted {variant} in {seconds:.0f} s", file=sys.stderr, flush=True)
    for variant in VARIANTS[1:]:
        signatures[variant] = tf.saved_model.load(str(dirs[variant])).signatures[SIGNATURE]
    for batch in BATCHES:
        given = {key: tf.constant(value) for key, value in feeds(signatures["float32"], sizes, batch).items()}
        calls = {v: (lambda s=s, f=named(s, given): s(**f)) for v, s in signatures.items()}
        times = bench.time_rotated(calls, sizes.rounds)
        row.seconds[batch] = {variant: statistics.median(t) for variant, t in times.items()}
        print(f"{name} batch {batch}: {row.seconds[batch]}", file=sys.stderr, flush=True)
    return row


def _cell(row: ModelRow, batch: int, variant: str) -> str:
    base, mine = row.seconds[batch]["float32"], row.seconds[batch][variant]
    return f"{1e3 * mine:.1f} ms ({base / mine:.2f}x)"


def render(rows: Sequence[ModelRow], sizes: Sizes, elapsed_s: float) -> str:
    text = [m for m in (r.model for r in rows) if m not in IMAGE_BACKBONES]
    lines = ["## CPU, bfloat16: keras_hub backbones served (issue 48)", "",
             f"{machine_line()}. {load_line()}: other sessions shared the cores, so read the ratios (same run,"
             " rotated calls), not the milliseconds. bfloat16 is emulated on this AVX2-only CPU (no AVX512-BF16,"
             " no AMX): a ratio below 1 here says nothing of a CPU that computes in bfloat16, which is unmeasured.",
             "", f"Backbones from `amp_rewrite.testing.hub` with random weights, {sizes.layers} layers,"
             f" {sizes.width} wide (heads {max(2, sizes.width // 64)}, feed-forward {2 * sizes.width})"
             + (f"; text models ({', '.join(text)}) on {sizes.sequence} tokens, vocabulary {sizes.vocabulary}"
                if text else "")
             + f"; ViT and ResNet on {sizes.image}x{sizes.image}x3 images (ResNet: {sizes.layers} stages of one basic"
             f" block, 64 then {2 * sizes.resnet_width} filters). Served through `{SIGNATURE}` of each SavedModel;"
             f" median of {sizes.rounds} rotated calls; in brackets float32's median over the variant's.", "",
             "| model | batch | float32 | " + " | ".join(LABELS[v] for v in VARIANTS[1:]) + " |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        for batch in sorted(row.seconds):
            cells = " | ".join(_cell(row, batch, v) for v in VARIANTS[1:])
            lines.append(f"| {row.model} | {batch} | {1e3 * row.seconds[batch]['float32']:.1f} ms | {cells} |")
    unconverted = [row.model for row in rows if ALL_FLOAT32 in row.tuned_lines]
    if unconverted:
        lines += ["", f"`--tune speed` kept every node float32 in {', '.join(unconverted)}: that column runs"
                      " float32's ops in the graph convert rewrote, so its distance from 1.00x there is not"
                      " bfloat16: load from other sessions, or how the rewritten SavedModel runs float32 (this"
                      " run does not tell the two apart)."]
    lines += ["", "What `--tune speed` said (convert with tuning, seconds in all):", ""]
    lines += [f"- {row.model}: {row.tune_s:.0f} s. {row.tuned_lines or '(no Timing line)'}" for row in rows
              if row.seconds]
    errors = [error for row in rows for error in row.errors]
    if errors:
        lines += ["", "Failures: " + "; ".join(errors)]
    command = " ".join(["tools/bench_hub_serving.py", *sys.argv[1:]])
    lines += ["", f"`{command}`, {elapsed_s / 60:.0f} min.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser(
        __doc__.split("\n\n")[0], smoke="checks this script: a tiny GPT-2, one round; writes a copy of"
        " BENCHMARKS.md in a temporary directory; not a measurement",
        models=f"comma-separated, of {','.join(BACKBONES)} (default {DEFAULT_MODELS}; --smoke: gpt2)",
        rounds=f"timed rounds (default {FULL.rounds}, smoke {SMOKE.rounds})")
    args = parser.parse_args(argv)
    args.models = args.models or (None if args.smoke else DEFAULT_MODELS)
    models, sizes = chosen(args, parser, allowed=BACKBONES, smoke_models="gpt2", full=FULL, smoke=SMOKE)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-hub-serving-") as workdir:
        rows: list[ModelRow] = []
        for model in models:  # the section rewritten after each model: a run cut short keeps what it measured
            rows.append(measure(model, sizes, Path(workdir), args.smoke))
            section = render(rows, sizes, time.perf_counter() - started)
            bench.write_section(None if args.no_write else args.output, SECTION, section,
                                Path(workdir) if args.smoke else None)
        print(section)
    return 1 if any(row.errors for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
