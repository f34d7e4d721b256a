"""Break the code on purpose, one small fault at a time, and report which tests catch each.

Each mutant is one deliberate fault in the source (swap two colouring steps, drop a cast,
flip a list entry, an off-by-one in a port; weights rounded twice, FP8
gradients in E4M3, calibration's range rule off, the Session mirror's values in the wrong
dtype, the live rewrite's private copies unregistered, ...), applied to a copy of the
checkout (the files ``git ls-files`` lists, links as links) in a temporary directory: the
checkout itself is never changed. Every mutant's text must occur exactly once in the
source, or the tool stops before any test runs, naming it (a mutant is never skipped).
The unmutated copy runs each subset first: a subset that fails unmutated proves nothing,
and the tool exits 2. Then each mutant's relevant tests (a subset of ``tests/``, not the
whole suite) run against its copy; a mutant no test fails "survives", and the tool exits 1.

    .venv/bin/python tools/mutation_check.py              # every mutant (about 30 minutes on 2 cores)
    .venv/bin/python tools/mutation_check.py drop-cast    # the named ones
    .venv/bin/python tools/mutation_check.py --smoke      # every anchor, the copy, one mutant on one test

The report is a Markdown table: mutant, fault, the tests run, failed/run and which failed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COLOURING = "amp_rewrite/core/colouring.py"
CASTS = "amp_rewrite/core/casts.py"
PASS_TESTS = ("tests/test_passes.py", "tests/test_grappler_cases.py", "tests/test_rewrite.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    fault: str  # what the fault does, in words
    path: str  # file changed, relative to the checkout
    edits: tuple[tuple[str, str], ...]  # (text, replacement): each text occurs exactly once
    tests: tuple[str, ...]  # pytest arguments: the relevant subset


def _swap(first: str, second: str) -> tuple[tuple[str, str], ...]:
    """Edits that exchange two unique texts."""
    marker = "\0SWAPPED\0"
    return ((first, marker), (second, first), (marker, second))


MUTANTS = (
    Mutant(
        "swap-steps",
        "paint runs step 7.6 (allow through clear) before 7.5 (infer after allow)",
        COLOURING,
        _swap("    found = add_infer_after_allow(ctx, allow, deny)\n",
              "    found = propagate_allow_through_clear(ctx, allow, deny)\n"),
        PASS_TESTS,
    ),
    Mutant(
        "drop-cast",
        "no cast back to float32 where a converted value meets a float32 consumer",
        CASTS,
        (("            if not moved:\n", "            if not moved or src_allow:\n"),),
        PASS_TESTS,
    ),
    Mutant(
        "flip-list-entry",
        "lists/float16.yaml: Tanh moves from the infer list to the clear list",
        "lists/float16.yaml",
        (("    Tanh:\n    TanhGrad:\n", "    TanhGrad:\n"), ("  ops:\n    Abs:\n", "  ops:\n    Tanh:\n    Abs:\n")),
        ("tests/test_lists.py", "tests/test_grappler_cases.py"),
    ),
    Mutant(
        "port-off-by-one",
        "a cast's consumers are judged by the input slot before theirs",
        CASTS,
        (("node_types[dst].input_slots[position]]", "node_types[dst].input_slots[position - 1]]"),),
        PASS_TESTS,
    ),
    Mutant(
        "tensor-name-port",
        "reading a GraphDef, an input 'x:1' is taken from port 0 of x (off by one)",
        "amp_rewrite/core/graph_io.py",
        (("                    port = int(port_text)\n", "                    port = int(port_text) - 1\n"),),
        ("tests/test_graph_io.py", "tests/test_grappler_cases.py"),
    ),
    Mutant(
        "deny-through-infer-only",
        "deny no longer stops at infer ops that lead nowhere deny: only deny ops are stoppers",
        COLOURING,
        (("stoppers, clear, kept = ctx.ops, lists.deny | lists.infer,", "stoppers, clear, kept = ctx.ops, lists.deny,"),),
        PASS_TESTS,
    ),
    Mutant(
        "recurrent-edge-any",
        "NextIteration is converted when any Merge it feeds is, not all",
        COLOURING,
        (("        if all(m in allow for m in merges) and node not in ctx.kept:",
          "        if any(m in allow for m in merges) and node not in ctx.kept:"),),
        PASS_TESTS + ("tests/test_functions.py::test_simple_loop", "tests/test_functions.py::test_propagation_through_simple_loop"),
    ),
    Mutant(
        "existing-cast-any",
        "an existing Cast is retargeted when any consumer is converted, not all",
        COLOURING,
        (("        if consumers and all(c in allow for c in consumers):",
          "        if consumers and any(c in allow for c in consumers):"),),
        PASS_TESTS,
    ),
    Mutant(
        "bounded-exp-any-constant",
        "c * f(x) counts as non-positive when any element of the constant c is <= 0, not all",
        COLOURING,
        (("bool(np.all(values <= 0))", "bool(np.any(values <= 0))"),),
        ("tests/test_rewrite.py", "tests/test_functions.py::test_bounded_exp_in_a_function_body"),
    ),
    Mutant(
        "kernel-memo-ignores-device",
        "the kernel memo shares one answer between devices",
        COLOURING,
        (("        key = (op, attr, self.kernel_device.get(node))", "        key = (op, attr)"),),
        PASS_TESTS,
    ),
    Mutant(
        "tensor-list-keeps-allow-reason",
        "a TensorList member the cluster rule denies keeps the allow-list reason it had",
        COLOURING,
        (("                if v not in deny:\n                    found[v] = Reason(Rule.TENSOR_LIST, \"TensorList cluster shares one dtype and a member must stay float32\")",
          "                if v not in deny and v not in allow:\n                    found[v] = Reason(Rule.TENSOR_LIST, \"TensorList cluster shares one dtype and a member must stay float32\")"),),
        ("tests/test_passes.py",),
    ),
    Mutant(
        "nested-func-calls",
        "a node also calls the functions named inside its func attrs' own attrs",
        "amp_rewrite/core/functions.py",
        (("        if kind == \"func\":\n            yield value.func.name\n",
          "        if kind == \"func\":\n            yield value.func.name\n"
          "            yield from (v.func.name for v in value.func.attr.values() if v.HasField(\"func\"))\n"),),
        ("tests/test_functions.py", "tests/test_cross_function.py"),
    ),
    Mutant(
        "fetch-not-preserved",
        "fetched nodes are painted like any other",
        "amp_rewrite/core/preparation.py",
        (("    preserved = set(fetches)\n", "    preserved = set()\n"),),
        PASS_TESTS,
    ),
    # Beyond the pass. Each anchor is a line that states its rule outright, the least likely to move.
    Mutant(
        "weights-rounded-through-float16",
        "weights stored bfloat16 are rounded through float16 first, not once as TensorFlow's Cast rounds them",
        "amp_rewrite/core/weights.py",
        (("        return np.asarray(values, np.float32).astype(tf.as_dtype(dtype).as_numpy_dtype)\n",
          "        return np.asarray(values, np.float32).astype(np.float16).astype(tf.as_dtype(dtype).as_numpy_dtype)\n"),),
        ("tests/test_weights.py",),
    ),
    Mutant(
        "writer-resums-chunk",
        "the low checkpoint's writer sums the sizes its chunk holds again for each key it adds (quadratic in a"
        " chunk's keys)",
        "amp_rewrite/cli/weights.py",
        (("                    if self.pieces and (self.held + elements) * 4 > checkpoint.chunk_bytes:\n",
          "                    if self.pieces and (sum(p.elements for p in self.pieces) + elements) * 4 > \\\n"
          "                            checkpoint.chunk_bytes:\n"),),
        ("tests/test_weights.py",),
    ),
    Mutant(
        "fp8-gradient-e4m3",
        "FP8 training quantizes gradients to E4M3 (weights' format) instead of E5M2",
        "amp_rewrite/core/float8/formats.py",
        (('E5M2 = Format("float8_e5m2", types_pb2.DT_FLOAT8_E5M2, 57344.0)',
          'E5M2 = Format("float8_e4m3fn", types_pb2.DT_FLOAT8_E4M3FN, 448.0)'),),
        ("tests/test_float8_training.py",),
    ),
    Mutant(
        "calibration-range-rule-off",
        "calibration no longer keeps float32 a tensor beyond float16's largest value (only repair is left)",
        "amp_rewrite/calibration/calibrate.py",
        (("        if stats.max_abs > self.limit:\n", "        if stats.max_abs > math.inf:\n"),),
        ("tests/test_calibration.py",),
    ),
    Mutant(
        "session-fetch-dtype",
        "the Session mirror returns a converted fetch in its low dtype, not the user's float32",
        "amp_rewrite/training/session.py",
        (("inner, None if dtype.as_datatype_enum == user else tf.as_dtype(user).base_dtype.as_numpy_dtype)",
          "inner, None)"),),
        ("tests/test_session.py",),
    ),
    Mutant(
        "live-private-copy-shares-name",
        "the live rewrite names a nested function's private copy as the shared one: the copy is never"
        " registered, and the nested function runs float32",
        "amp_rewrite/training/tracing.py",
        (('    return f"{name}_amp_{owner}"\n', "    return name\n"),),
        ("tests/test_live.py",),
    ),
    Mutant(
        "bounds-loosest-table",
        "an integer input that indexes two tables is drawn within the larger one, not the smaller",
        "amp_rewrite/core/bounds.py",
        (("    tightest = min(bounds, key=lambda b: (b.high, b.table))\n",
          "    tightest = max(bounds, key=lambda b: (b.high, b.table))\n"),),
        ("tests/test_random_inputs.py",),
    ),
    Mutant(
        "prefix-counts-all-equal",
        "a generated sequence's identical prefix counts every equal token, also after the first difference",
        "amp_rewrite/calibration/validate.py",
        (("    return np.where(equal.all(axis=1), length, np.argmin(equal, axis=1)), length\n",
          "    return equal.sum(axis=1), length\n"),),
        ("tests/test_random_inputs.py", "tests/test_decode.py"),
    ),
    Mutant(
        "cache-updates-not-clear",
        "with linked loops the in-place buffer updates stay in no list, so a KV cache is cast every iteration",
        "amp_rewrite/core/boundaries.py",
        (("    added = {op: why for op, why in IN_PLACE_UPDATE_OPS.items() if op_lists.colour(op) is None}\n",
          "    added = {}\n"),),
        ("tests/test_decode.py",),
    ),
    Mutant(
        "hoist-written-weight",
        "a loop's weight cast is hoisted out of the body even where the body writes or hands on the variable",
        "amp_rewrite/core/hoist.py",
        (("        if any(node.op != \"ReadVariableOp\" for node in readers):\n",
          "        if False:\n"),),
        ("tests/test_decode.py", "tests/test_weights.py"),
    ),
    Mutant(
        "doctor-last-nonfinite",
        "the doctor names the last non-finite op of the step, not the first",
        "amp_rewrite/core/instrument.py",
        (("    return next((name for name in order if name in bad), None)\n",
          "    return next((name for name in reversed(order) if name in bad), None)\n"),),
        ("tests/test_doctor.py", "tests/test_diverge.py"),
    ),
    Mutant(
        "stuck-never-said",
        "training stuck at the loss scale's floor is never said",
        "amp_rewrite/training/skips.py",
        (("        return tf.cond(tf.equal(run, STUCK_STEPS), say, lambda: tf.identity(run))\n",
          "        return tf.identity(run)\n"),),
        ("tests/test_doctor.py::test_the_issue_s_model_is_stuck_and_says_so_once",),
    ),
    Mutant(
        "loop-scale-unused",
        "--tune speed runs a loop whole and then models its body from the ops timed alone all the same",
        "amp_rewrite/tuning/decide.py",
        (("        return self.problem.loop_scale.get(batch, 1.0) if self.problem.looped(item) else 1.0\n",
          "        return 1.0\n"),),
        ("tests/test_tuning_loops.py",),
    ),
    Mutant(
        "casts-swapped",
        "the cast back to float32 is charged the cast down's timing, and the other way round",
        "amp_rewrite/tuning/decide.py",
        (("        return back * repeats, down * repeats\n",
          "        return down * repeats, back * repeats\n"),),
        ("tests/test_tuning_loops.py", "tests/test_tuning.py"),
    ),
)
# --smoke: a mutant and a single test that catches it in seconds.
SMOKE_MUTANT, SMOKE_TEST = "flip-list-entry", "tests/test_lists.py::test_builtin_lists_equal_grappler_dump"


def _copy_checkout(directory: Path) -> None:
    """The files git tracks, as the working tree has them; a link stays a link."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source, target = ROOT / name, directory / name
        if not os.path.lexists(source):  # deleted in the working tree, not yet in the index
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        else:
            shutil.copy2(source, target)


def _mutated(text: str, mutant: Mutant) -> str:
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"error: mutant {mutant.name}: {mutant.path} holds {count} copies of {old!r}, expected 1;"
                             " update the mutant to the current source")
        text = text.replace(old, new)
    return text


def _apply(directory: Path, mutant: Mutant) -> None:
    path = directory / mutant.path
    path.write_text(_mutated(path.read_text(encoding="utf-8"), mutant), encoding="utf-8")


_RESULT = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)
_COUNTS = re.compile(r"(\d+) (passed|failed|error|errors|skipped|xfailed|xpassed)")


def _run_tests(directory: Path, tests: tuple[str, ...]) -> tuple[list[str], int, str]:
    """(failing test ids, tests run, pytest's last line) for ``tests`` in ``directory``."""
    environ = {**os.environ, "PYTHONPATH": str(directory), "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONDONTWRITEBYTECODE": "1"}
    environ.pop("AMP_RECORD_GRAPPLER", None)
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--tb=no", *tests]
    process = subprocess.run(command, cwd=directory, env=environ, capture_output=True, text=True)
    output = process.stdout + process.stderr
    failing = sorted({match[1] for match in _RESULT.findall(output)})
    counts = {kind: int(number) for number, kind in _COUNTS.findall(output.strip().splitlines()[-1] if output.strip() else "")}
    ran = sum(counts.values())
    if process.returncode not in (0, 1):  # 2+: interrupted, usage or collection error
        failing = failing or [f"pytest exited {process.returncode}"]
    return failing, ran, (output.strip().splitlines() or [""])[-1]


def _check_imports_the_copy(directory: Path) -> None:
    """The copy's package is the one its tests import (found, not run: no TensorFlow import)."""
    environ = {**os.environ, "PYTHONPATH": str(directory), "TF_CPP_MIN_LOG_LEVEL": "2"}
    found = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('amp_rewrite')"
                            ".origin)"], cwd=directory, env=environ, capture_output=True, text=True).stdout.strip()
    if not found.startswith(str(directory)):
        raise SystemExit(f"error: the copy's amp_rewrite is not the one imported ({found}); is it installed elsewhere?")


def _check_anchors() -> None:
    """Every mutant's text occurs exactly once in today's source, or the run stops naming it."""
    for mutant in MUTANTS:
        _mutated((ROOT / mutant.path).read_text(encoding="utf-8"), mutant)


def _check_clean(temporary: Path, subsets: set[tuple[str, ...]]) -> str | None:
    """Copy the checkout and run each subset on it unmutated: why one proves nothing, or None."""
    clean = temporary / "clean"
    _copy_checkout(clean)
    _check_imports_the_copy(clean)
    for tests in sorted(subsets):
        failing, ran, last = _run_tests(clean, tests)
        if failing or not ran:
            return f"the unmutated subset {' '.join(tests)} does not pass: {last}"
    return None


def _run_mutant(temporary: Path, mutant: Mutant) -> tuple[list[str], int, str]:
    """(failing test ids, tests run, table row) of ``mutant``'s subset on a mutated copy."""
    directory = temporary / mutant.name
    _copy_checkout(directory)
    _apply(directory, mutant)
    started = time.monotonic()
    failing, ran, _ = _run_tests(directory, mutant.tests)
    print(f"{mutant.name}: {len(failing)} of {ran} failed ({time.monotonic() - started:.0f} s)", file=sys.stderr,
          flush=True)
    shutil.rmtree(directory)
    shown = ", ".join(f"`{t.split('::', 1)[-1]}`" for t in failing[:4])
    more = f" and {len(failing) - 4} more" if len(failing) > 4 else ""
    row = (f"| {mutant.name} | {mutant.fault} | {' '.join(t.removeprefix('tests/') for t in mutant.tests)} "
           f"| {len(failing)}/{ran} | {shown or '**none: survived**'}{more} |")
    return failing, ran, row


TABLE_HEAD = "| mutant | fault | tests run | failed/run | failing tests |\n|---|---|---|---:|---|"


def smoke() -> int:
    """Every anchor, the copy, and one mutant caught by one test (clean first)."""
    _check_anchors()
    mutant = next(m for m in MUTANTS if m.name == SMOKE_MUTANT)
    mutant = Mutant(mutant.name, mutant.fault, mutant.path, mutant.edits, (SMOKE_TEST,))
    with tempfile.TemporaryDirectory(prefix="amp-mutants-smoke-") as temporary:
        why = _check_clean(Path(temporary), {mutant.tests})
        if why is not None:
            print(f"error: {why}", file=sys.stderr)
            return 2
        failing, _, row = _run_mutant(Path(temporary), mutant)
    print(f"{len(MUTANTS)} mutants' anchors found once each\n{TABLE_HEAD}\n{row}")
    return 0 if failing else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"mutants to run (default: all): {', '.join(m.name for m in MUTANTS)}")
    parser.add_argument("--smoke", action="store_true", help=f"every anchor, and {SMOKE_MUTANT} on {SMOKE_TEST}")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    unknown = sorted(set(args.names) - {m.name for m in MUTANTS})
    if unknown:
        parser.error(f"unknown mutant(s) {', '.join(unknown)}; choose from {', '.join(m.name for m in MUTANTS)}")
    mutants = [m for m in MUTANTS if not args.names or m.name in args.names]
    _check_anchors()  # every fault still applies to the source, before any test runs
    rows, survived = [], []
    with tempfile.TemporaryDirectory(prefix="amp-mutants-") as temporary:
        why = _check_clean(Path(temporary), {m.tests for m in mutants})
        if why is not None:
            print(f"error: {why}", file=sys.stderr)
            return 2
        for mutant in mutants:
            failing, _, row = _run_mutant(Path(temporary), mutant)
            rows.append(row)
            if not failing:
                survived.append(mutant.name)
    print(TABLE_HEAD)
    print("\n".join(rows))
    if survived:
        print(f"\nsurvived: {', '.join(survived)}: add a test that fails for each", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
