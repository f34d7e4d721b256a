"""Decode speed of converted LLM decode loops, and how often they pick float32's tokens (issue 48).

Speed: keras_hub's GPT-2, Gemma and Llama causal LMs (``amp_rewrite.testing.decode``:
random weights, no download, no preprocessor, greedy sampler), ``--width`` wide and
``--layers`` deep with a vocabulary cut to ``--vocab`` tokens (the embedding and the logits
are not what this measures, and a 50k-row table is memory this machine shares), each with
its ``generate_step`` saved as a SavedModel signature (token ids and padding mask in, token
ids out: one ``While`` loop with a KV cache). Variants, all with the same weights:

* float32, the export;
* ours: ``amp-rewrite convert --target bfloat16`` (loop boundaries linked, the cache carried
  in bfloat16, weights stored low), with the casts one iteration runs and the same count
  with grappler's per-function boundaries (``rewrite_graph_def``'s default);
* Keras' ``mixed_bfloat16`` policy: the model built under the policy, float32's weights
  copied in, exported the same way.

The variants are loaded in one process and called in turn (``bench.time_rotated``: one
call each per round, in an order rotated per round, so load from other processes falls on
all alike); tokens/s = batch x generated tokens / the median call, and the ratio is
float32's median time over the variant's, from the same run. ``--tune speed`` is not a
column: timing each op of a 768-wide loop body takes longer than this run.

Agreement: a GPT-2-style model (byte vocabulary) trained for ``--train-s`` seconds on text
every Linux machine has (``/usr/share/common-licenses``, else this Python's LICENSE files),
so its logits are not flat, converted the same way; on held-out 16-byte prompts, the share
whose first generated token equals float32's (goal >= 98% in bfloat16) and the mean length
of the identical prefix over 32 generated tokens.

    TF_CPP_MIN_LOG_LEVEL=2 nice -n 10 .venv/bin/python tools/bench_decode.py     # ~30 min on 2 cores
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_decode.py --smoke       # tiny: checks the script

The markdown goes to stdout and replaces the ``cpu-bfloat16-decode`` section of BENCHMARKS.md
(``--smoke``: of a copy of it in a temporary directory).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402  (tools/bench.py: the shared timing loop and BENCHMARKS.md's sections)
from bench_pass import machine_line  # noqa: E402

from amp_rewrite.calibration.savedmodel import effective_lists, read_model, rewrite_model  # noqa: E402
from amp_rewrite.calibration.validate import identical_prefixes  # noqa: E402
from amp_rewrite.testing.decode import (  # noqa: E402
    KERAS_HUB_MODELS, CausalLMShape, GenerateStep, build_causal_lm, prompt_feeds,
)
from amp_rewrite.testing.loops import casts_per_iteration  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTION = "cpu-bfloat16-decode"
BATCHES = (1, 8)
VARIANTS = ("float32", "ours", "keras-policy")
GENERATED = 32  # tokens generated per prompt in the agreement check
PROMPT = 16


@dataclass(frozen=True)
class Sizes:
    shape: CausalLMShape
    prompt: int
    rounds: int
    train_s: float


def save(causal_lm, path: Path, length: int) -> Path:
    module = GenerateStep(causal_lm, length)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.generate})
    return path


def convert(source: Path, destination: Path, in_process: bool = False) -> str:
    """``amp-rewrite convert --target bfloat16``; its summary. ``in_process`` (--smoke):
    ``amp_rewrite.cli.main`` in this process, which saves a TensorFlow import per conversion."""
    done = bench.amp_rewrite_cli(["convert", str(source), str(destination), "--target", "bfloat16"], in_process)
    if done.returncode != 0:
        raise RuntimeError(f"convert {source} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def loop_casts(path: Path, cross_function: bool | str) -> int:
    """Casts one iteration of the saved model's loop runs, rewritten without the weights step."""
    model = read_model(path)
    result = rewrite_model(model, target="bfloat16", lists=effective_lists("bfloat16"), cross_function=cross_function)
    return sum(casts_per_iteration(result.graph_def).values())


def serving(path: Path):
    return tf.saved_model.load(str(path)).signatures["serving_default"]


def generate(signature, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return signature(**{name: tf.constant(value) for name, value in feeds.items()})["token_ids"].numpy()


@dataclass(frozen=True)
class SpeedRow:
    model: str
    batch: int
    seconds: dict[str, float]   # variant -> median seconds per call
    tokens: int                 # tokens generated per call
    casts: tuple[int, int]      # per iteration: ours, grappler's boundaries
    loops_line: str


def measure_model(name: str, sizes: Sizes, workdir: Path, in_process: bool = False) -> list[SpeedRow]:
    """The three variants of one model, timed at each batch (``in_process``: see ``convert``)."""
    shape = sizes.shape
    float32 = build_causal_lm(name, shape, seed=0)
    source = save(float32, workdir / f"{name}-float32", shape.length)
    policy = build_causal_lm(name, shape, seed=0, dtype="mixed_bfloat16")
    policy.set_weights(float32.get_weights())
    dirs = {"float32": source, "keras-policy": save(policy, workdir / f"{name}-policy", shape.length)}
    summary = convert(source, workdir / f"{name}-ours", in_process)
    dirs["ours"] = workdir / f"{name}-ours"
    loops_line = next((line for line in summary.splitlines() if line.startswith("Loops:")), "Loops: (none)")
    casts = (sum(casts_per_iteration(read_model(dirs["ours"]).graph_def).values()), loop_casts(source, False))
    signatures = {variant: serving(dirs[variant]) for variant in VARIANTS}
    rows = []
    for batch in BATCHES:
        feeds = prompt_feeds(shape, batch, sizes.prompt, seed=batch)
        times = bench.time_rotated({v: (lambda s=s: generate(s, feeds)) for v, s in signatures.items()},
                                   sizes.rounds)
        rows.append(SpeedRow(name, batch, {v: statistics.median(t) for v, t in times.items()},
                             batch * (shape.length - sizes.prompt), casts, loops_line))
        print(f"{name} batch {batch}: {rows[-1]}", file=sys.stderr, flush=True)  # a long run's progress
    return rows


def corpus() -> bytes:
    """Plain English text every Linux machine has: its licence texts (else Python's LICENSE files)."""
    licences = Path("/usr/share/common-licenses")
    files = sorted(p for p in licences.iterdir() if p.is_file()) if licences.is_dir() else []
    if not files:
        files = sorted(Path(sys.prefix).rglob("LICENSE*"))[:50]
    return b"\n".join(p.read_bytes() for p in files)


def train_byte_lm(text: bytes, shape: CausalLMShape, seconds: float):
    """A GPT-2 over bytes, trained for about ``seconds`` on windows of ``text``; and its step count."""
    import keras

    causal_lm = build_causal_lm("gpt2", shape, seed=0)
    causal_lm.compile(optimizer=keras.optimizers.Adam(1e-3), sampler="greedy")
    data = np.frombuffer(text, np.uint8).astype(np.int32)
    rng = np.random.default_rng(0)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        starts = rng.integers(0, len(data) - shape.length - 1, 32)
        windows = np.stack([data[s:s + shape.length + 1] for s in starts])
        x = {"token_ids": windows[:, :-1], "padding_mask": np.ones_like(windows[:, :-1], bool)}
        causal_lm.train_on_batch(x, windows[:, 1:])
        steps += 1
    return causal_lm, steps


@dataclass(frozen=True)
class Agreement:
    prompts: int
    first_token: float    # share of prompts whose first generated token equals float32's
    mean_prefix: float    # mean identical prefix over GENERATED tokens
    steps: int
    corpus_bytes: int


def measure_agreement(sizes: Sizes, workdir: Path, prompts: int = 128, in_process: bool = False) -> Agreement:
    shape = CausalLMShape(vocab=256, width=128, layers=2, heads=4, length=PROMPT + GENERATED)
    if sizes.train_s < 30:
        shape = replace(shape, width=32)
    text = corpus()
    causal_lm, steps = train_byte_lm(text[: len(text) * 9 // 10], shape, sizes.train_s)
    source = save(causal_lm, workdir / "trained-float32", shape.length)
    convert(source, workdir / "trained-ours", in_process)
    held_out = np.frombuffer(text[len(text) * 9 // 10:], np.uint8).astype(np.int32)
    starts = np.random.default_rng(1).integers(0, len(held_out) - PROMPT, prompts)
    token_ids = np.zeros((prompts, shape.length), np.int32)
    token_ids[:, :PROMPT] = np.stack([held_out[s:s + PROMPT] for s in starts])
    mask = np.zeros_like(token_ids, bool)
    mask[:, :PROMPT] = True
    feeds = {"token_ids": token_ids, "padding_mask": mask}
    reference = generate(serving(source), feeds)[:, PROMPT:]
    candidate = generate(serving(workdir / "trained-ours"), feeds)[:, PROMPT:]
    prefixes, _ = identical_prefixes(reference, candidate)
    return Agreement(prompts, float(np.mean(reference[:, 0] == candidate[:, 0])), float(np.mean(prefixes)), steps,
                     len(text))


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} CPUs at the end of the run"


def render(rows: Sequence[SpeedRow], agreement: Agreement | None, sizes: Sizes, elapsed_s: float,
           smoke: bool) -> str:
    shape = sizes.shape
    lines = ["## CPU, bfloat16: LLM decode loops (issue 48)", "",
             f"{machine_line()}. {load_line()}: other sessions shared the cores, so read the ratios (same run,"
             " rotated calls), not the absolute tokens/s.", "",
             f"keras_hub causal LMs, {shape.width} wide, {shape.layers} layers, {shape.heads} heads, vocabulary cut to"
             f" {shape.vocab} tokens (random weights), prompt {sizes.prompt} then {shape.length - sizes.prompt}"
             f" generated tokens (greedy `generate_step` as a SavedModel signature); median of {sizes.rounds}"
             f" rotated calls. `--tune speed` not run (timing each op of the loop body takes longer than this run).",
             "", "| model | batch | float32 tokens/s | ours | Keras `mixed_bfloat16` | casts per iteration:"
             " ours as written / grappler's boundaries, weights float32 |", "|---|---|---|---|---|---|"]
    for row in rows:
        base = row.seconds["float32"]
        cells = [f"{row.tokens / row.seconds[v]:.1f} tok/s ({base / row.seconds[v]:.2f}x)" for v in VARIANTS[1:]]
        lines.append(f"| {row.model} | {row.batch} | {row.tokens / base:.1f} | {' | '.join(cells)} |"
                     f" {row.casts[0]} / {row.casts[1]} |")
    lines += ["", "What convert said of each model's loop:", ""]
    lines += [f"- {row.model}: {row.loops_line}" for row in rows if row.batch == BATCHES[0]]
    if agreement is not None:
        lines += ["", f"Agreement on a trained model: a byte-level GPT-2 (2 layers, 128 wide) trained"
                      f" {agreement.steps} steps (batch 32) on {agreement.corpus_bytes / 1e3:.0f} kB of licence"
                      f" texts; {agreement.prompts} held-out {PROMPT}-byte prompts, {GENERATED} tokens generated:"
                      f" first token equal to float32's in {100 * agreement.first_token:.1f}% (goal >= 98%),"
                      f" identical prefix {agreement.mean_prefix:.1f} of {GENERATED} tokens on average."]
    command = " ".join(["tools/bench_decode.py", *sys.argv[1:]])
    lines += ["", f"`{command}`, {elapsed_s / 60:.0f} min.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(KERAS_HUB_MODELS), help="comma-separated: gpt2,gemma,llama")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--length", type=int, default=40, help="prompt and generated tokens together")
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-s", type=float, default=180.0, help="seconds to train the agreement model")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script")
    args = parser.parse_args(argv)
    sizes = Sizes(CausalLMShape(args.vocab, args.width, args.layers, args.heads, args.length), args.prompt,
                  args.rounds, args.train_s)
    models = args.models.split(",")
    if args.smoke:  # one model: the others take the same path (tests/test_tools.py runs this in make test)
        sizes, models = Sizes(CausalLMShape(64, 32, 2, 2, 16), 4, 2, 2.0), models[:1]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-decode-") as workdir:
        rows = [row for name in models for row in measure_model(name, sizes, Path(workdir), args.smoke)]
        agreement = measure_agreement(sizes, Path(workdir), in_process=args.smoke) if sizes.train_s > 0 else None
        section = render(rows, agreement, sizes, time.perf_counter() - started, args.smoke)
        print(section)
        bench.write_section(None if args.no_write else args.output, SECTION, section,
                            Path(workdir) if args.smoke else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
