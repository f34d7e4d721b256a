"""What calibration costs, in time and memory, against one float32 load and first call (``make bench``).

Models: the trained MobileNetV2 of ``tests/trained_models.py`` (alpha 0.35, 32×32 digits,
its 64 calibration images) and the BERT-base encoder of ``tools/bench.py`` (12 layers, 128
tokens, random weights, 8 samples of token ids below the vocabulary size); ResNet50 at
224×224 (random weights, 8 N(0,1) images) with ``--models resnet50``. Each is exported as
a SavedModel and calibrated (``calibrate.run_calibration``, as ``amp-rewrite convert
--calibrate DATA.npz`` does) for each of ``--targets``: float16 (as a plain ``--calibrate``
runs, one validation run on these models) and float8 (the float16 calibration, then float8
runs, each loading the model afresh or adding to the loaded session).

Every measurement runs in a process of its own, so each peak RSS (``ru_maxrss``) is one
step's: the baseline process runs ``tf.saved_model.load`` and one first call of the
signature on the same batch (the call that traces, optimizes and instantiates the model's
functions); a calibration process runs one calibration. Memory goal: a calibration's peak
at most ``MEMORY_GOAL`` times the load's (both with TensorFlow imported; the part above the
process after ``import tensorflow`` is printed too). Time goal: calibration within
``TIME_GOAL`` first calls. The time of calibration is split into: instrumenting the graphs
(Python), the TF1 loader (graph import and variable restore; how many loads), the model
runs (session.run: function instantiation and compute), the rewrites, adding a rewrite to
the loaded session (``statistics.Runner``), and the rest (Python: statistics, decisions).

    flock /tmp/amp_bigmem.lock env TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_calibration.py \\
        [--models mobilenet,bert,resnet50] [--targets float16,float8]
    .venv/bin/python tools/bench_calibration.py --smoke   # the trained MLP, float8, 8 samples: seconds
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIME_GOAL = 10.0    # calibration at most this many float32 first calls
MEMORY_GOAL = 2.0   # calibration's peak RSS at most this many times a load's
SAMPLES = 8         # BERT and ResNet50; MobileNetV2 takes its 64 calibration images
_RESULT = "bench_calibration result: "  # a measuring process's last line, then its JSON
_MODELS = ("mobilenet", "bert", "resnet50", "mlp")  # mlp: the trained MLP, for --smoke


def _rss_mb() -> float:
    """This process's resident memory now, MB."""
    for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mb() -> float:
    """This process's peak resident memory so far, MB (Linux: ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _paths() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    sys.path.insert(0, str(REPO / "tests"))


def _export(name: str, path: Path) -> None:
    """The model as a SavedModel at ``path``, its calibration batch at ``path``.npz."""
    _paths()
    import numpy as np
    import trained_models

    if name in ("mobilenet", "mlp"):
        trained = {"mobilenet": "digits_mobilenet", "mlp": "digits_mlp"}[name]
        trained_models.export(trained, path)
        data = trained_models.data(trained, "calibration")[0]
        if name == "mlp":
            data = {key: value[:SAMPLES] for key, value in data.items()}
        np.savez(f"{path}.npz", **data)
        return
    import bench  # tools/bench.py: the models
    import keras

    from amp_rewrite.calibration import validate
    from amp_rewrite.calibration.savedmodel import read_model

    keras.utils.set_random_seed(0)
    sizes = bench.FULL
    model = bench._build_resnet50(sizes) if name == "resnet50" else bench._build_bert(sizes)
    model.export(str(path), verbose=False)
    spec = validate.input_specs(read_model(path))[0]
    rng = np.random.default_rng(0)
    if name == "resnet50":
        value = rng.standard_normal((SAMPLES, sizes.image_size, sizes.image_size, 3), dtype=np.float32)
    else:
        value = rng.integers(0, sizes.bert_vocab, size=(SAMPLES, sizes.bert_seq), dtype=np.int32)
    np.savez(f"{path}.npz", **{spec.name: value})


def _load(path: Path) -> dict:
    """The baseline: ``tf.saved_model.load`` and one first call, timed, with the peak RSS."""
    import numpy as np
    import tensorflow as tf

    imported = _rss_mb()
    data = dict(np.load(f"{path}.npz"))
    started = time.perf_counter()
    loaded = tf.saved_model.load(str(path))
    load = time.perf_counter() - started
    function = loaded.signatures["serving_default"]
    started = time.perf_counter()
    function(**{key: tf.constant(value) for key, value in data.items()})
    first = time.perf_counter() - started
    return {"imported_mb": imported, "peak_mb": _peak_mb(), "load_s": load, "first_call_s": first,
            "samples": len(next(iter(data.values())))}


def _timed(owner: object, name: str, phase: str, spent: dict[str, float]) -> None:
    """Wrap ``owner.name`` so its wall time adds to ``spent[phase]`` (outermost call only) and
    its calls to ``spent[phase + ' calls']``."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if spent.get("_inside"):
            return function(*args, **kwargs)
        spent["_inside"], spent[f"{phase} calls"] = 1, spent[f"{phase} calls"] + 1
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - started
            spent["_inside"] = 0

    setattr(owner, name, wrapper)


def _calibrate(path: Path, target: str) -> dict:
    """One calibration for ``target``, timed by phase, with the peak RSS."""
    import numpy as np
    import tensorflow as tf

    from amp_rewrite.calibration import calibrate, statistics, validate
    from amp_rewrite.calibration.savedmodel import read_model
    from amp_rewrite.core.lists import load_lists
    from amp_rewrite.core.target import lookup_target

    imported = _rss_mb()
    spent: dict[str, float] = collections.defaultdict(float)
    _timed(statistics, "instrument", "instrumenting (Python)", spent)
    _timed(tf.compat.v1.saved_model.loader, "load", "TF1 loader: import and restore", spent)
    _timed(tf.compat.v1.Session, "run", "model runs (session.run)", spent)
    _timed(calibrate, "rewrite_model", "rewrites", spent)
    _timed(statistics, "_add", "adding a rewrite to the session", spent)
    data = dict(np.load(f"{path}.npz"))
    started = time.perf_counter()
    source = read_model(path)
    feeds, _ = validate.plan_feeds(source, data, 1)
    options = calibrate.Options(target=lookup_target(target, quantized=True), lists=load_lists("float16"))
    result = calibrate.run_calibration(source, feeds, options)
    seconds = time.perf_counter() - started
    spent.pop("_inside", None)
    phases = {phase: value for phase, value in spent.items() if not phase.endswith(" calls")}
    phases["the rest (Python: statistics, decisions)"] = seconds - sum(phases.values())
    return {"imported_mb": imported, "peak_mb": _peak_mb(), "seconds": seconds, "phases": phases,
            "loads": int(spent["TF1 loader: import and restore calls"]), "runs": result.validation_runs,
            "kept": len(result.kept), "ok": result.ok}


def _child(*args: str) -> dict:
    """Run this tool's ``--child ARGS`` in a process of its own; its JSON result."""
    process = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")})
    found = [line for line in process.stdout.splitlines() if line.startswith(_RESULT)]
    if process.returncode or not found:
        tail = "\n".join((process.stderr or process.stdout).strip().splitlines()[-12:])
        raise SystemExit(f"bench_calibration: {' '.join(args)} failed (exit {process.returncode}):\n{tail}")
    return json.loads(found[-1][len(_RESULT):])


def measure(name: str, targets: list[str], workdir: Path) -> list[str]:
    """One line per target: calibration's time and peak RSS against the load's, and where the time went."""
    path = workdir / name
    _child("export", name, str(path))
    base = _child("load", str(path))
    lines = []
    for target in targets:
        found = _child("calibrate", str(path), target)
        ratio, memory = found["seconds"] / base["first_call_s"], found["peak_mb"] / base["peak_mb"]
        above = (found["peak_mb"] - found["imported_mb"], base["peak_mb"] - base["imported_mb"])
        split = "; ".join(f"{phase} {spent:.1f} s ({spent / found['seconds']:.0%})"
                          for phase, spent in found["phases"].items())
        lines.append(
            f"{name} ({base['samples']} samples), {target}: calibration {found['seconds']:.1f} s; float32 first call"
            f" {base['first_call_s']:.2f} s (load {base['load_s']:.1f} s before it); ratio {ratio:.1f}x"
            f" ({'within' if ratio <= TIME_GOAL else 'over'} the goal of {TIME_GOAL:g}x); {found['runs']} validation"
            f" run(s), {found['loads']} load(s), {found['kept']} node(s) kept float32; outputs"
            f" {'within' if found['ok'] else 'OVER'} tolerance\n"
            f"  peak RSS: calibration {found['peak_mb']:.0f} MB, load and first call {base['peak_mb']:.0f} MB:"
            f" {memory:.2f}x ({'within' if memory <= MEMORY_GOAL else 'over'} the goal of {MEMORY_GOAL:g}x);"
            f" above the process after import ({found['imported_mb']:.0f} and {base['imported_mb']:.0f} MB):"
            f" {above[0]:.0f} MB and {above[1]:.0f} MB, {above[0] / above[1]:.2f}x\n"
            f"  where the time goes: {split}")
    return lines


def _smoke_target() -> str:
    """float8, where this TensorFlow has it (2.18+); float16 before."""
    from amp_rewrite.core.float8 import inference as float8
    from amp_rewrite.errors import AmpRewriteError

    try:
        float8.check_tensorflow()
    except AmpRewriteError:
        return "float16"
    return "float8"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mobilenet,bert", help="comma-separated of mobilenet, bert, resnet50"
                                                                   " (default mobilenet,bert)")
    parser.add_argument("--targets", default="float16,float8", help="comma-separated (default float16,float8)")
    parser.add_argument("--smoke", action="store_true", help="the trained MLP, float8 (float16 before TensorFlow 2.18), 8 samples: seconds")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        step, *rest = args.child
        found = {"export": lambda: _export(rest[0], Path(rest[1])) or {}, "load": lambda: _load(Path(rest[0])),
                 "calibrate": lambda: _calibrate(Path(rest[0]), rest[1])}[step]()
        print(_RESULT + json.dumps(found), flush=True)
        return 0
    models, targets = (["mlp"], [_smoke_target()]) if args.smoke else (args.models.split(","), args.targets.split(","))
    unknown = [m for m in models if m not in _MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from mobilenet, bert, resnet50")
    _paths()
    from bench_pass import machine_line

    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-bench-calibration-") as workdir:
        for name in models:
            print("\n".join(measure(name, targets, Path(workdir))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
