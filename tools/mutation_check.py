"""Break the pass on purpose, one small fault at a time, and report which tests catch each.

Each mutant is one deliberate fault in the source (swap two colouring steps, drop a cast,
flip a list entry, an off-by-one in a port, ...), applied to a copy of the checkout in a
temporary directory: the checkout itself is never changed. The mutant's relevant tests
(a fast subset of ``tests/``, not the whole suite) run against the copy; a mutant no test
fails "survives", and the tool exits 1. The unmutated copy runs each subset first: a
subset that fails unmutated proves nothing, and the tool exits 2.

    .venv/bin/python tools/mutation_check.py              # every mutant (about 10 minutes)
    .venv/bin/python tools/mutation_check.py drop-cast    # the named ones

The report is a Markdown table: mutant, fault, subset, tests that failed (of those run).
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
COPIED = ("amp_rewrite", "lists", "tests", "tools", "setup.py", "README.md", "Makefile")

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
)


def _copy_checkout(directory: Path) -> None:
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, directory / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, directory / name)


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
    environ = {**os.environ, "PYTHONPATH": str(directory), "TF_CPP_MIN_LOG_LEVEL": "2"}
    found = subprocess.run([sys.executable, "-c", "import amp_rewrite; print(amp_rewrite.__file__)"], cwd=directory,
                           env=environ, capture_output=True, text=True).stdout.strip()
    if not found.startswith(str(directory)):
        raise SystemExit(f"error: the copy's amp_rewrite is not the one imported ({found}); is it installed elsewhere?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"mutants to run (default: all): {', '.join(m.name for m in MUTANTS)}")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - {m.name for m in MUTANTS})
    if unknown:
        parser.error(f"unknown mutant(s) {', '.join(unknown)}; choose from {', '.join(m.name for m in MUTANTS)}")
    mutants = [m for m in MUTANTS if not args.names or m.name in args.names]
    for mutant in mutants:  # every fault still applies to the source, before any test runs
        _mutated((ROOT / mutant.path).read_text(encoding="utf-8"), mutant)
    rows, survived = [], []
    with tempfile.TemporaryDirectory(prefix="amp-mutants-") as temporary:
        clean = Path(temporary) / "clean"
        _copy_checkout(clean)
        _check_imports_the_copy(clean)
        for tests in sorted({m.tests for m in mutants}):
            failing, ran, last = _run_tests(clean, tests)
            if failing or not ran:
                print(f"error: the unmutated subset {' '.join(tests)} does not pass: {last}", file=sys.stderr)
                return 2
        for mutant in mutants:
            directory = Path(temporary) / mutant.name
            _copy_checkout(directory)
            _apply(directory, mutant)
            started = time.monotonic()
            failing, ran, last = _run_tests(directory, mutant.tests)
            seconds = time.monotonic() - started
            print(f"{mutant.name}: {len(failing)} of {ran} failed ({seconds:.0f} s)", file=sys.stderr, flush=True)
            if not failing:
                survived.append(mutant.name)
            shown = ", ".join(f"`{t.split('::', 1)[-1]}`" for t in failing[:4])
            more = f" and {len(failing) - 4} more" if len(failing) > 4 else ""
            rows.append(f"| {mutant.name} | {mutant.fault} | {' '.join(t.removeprefix('tests/') for t in mutant.tests)} "
                        f"| {len(failing)}/{ran}: {shown or '**none: survived**'}{more} |")
            shutil.rmtree(directory)
    print("| mutant | fault | tests run | failed |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    if survived:
        print(f"\nsurvived: {', '.join(survived)}: add a test that fails for each", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
