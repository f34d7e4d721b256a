"""Tools that cannot rot: every script in ``tools/`` runs here in its smoke mode.

``tools/X.py --smoke`` is the tool's own path on tiny inputs, in seconds, writing only
under a temporary directory; it exits 0 when it worked, or 77 (the test suites' "skipped")
where this machine cannot run it, saying why on stderr (no Chromium; a TensorFlow without
float8). A tool added without ``--smoke`` fails here, and so does one that writes into the
checkout (``git status``, ignored paths included, before and after it).

Each tool runs as ``python tools/X.py --smoke`` from the checkout's root would run it
(with the arguments ``SMOKE_ARGUMENTS`` adds, where a test checks what it wrote),
with its own TMPDIR, in a process of its own: one runner imports TensorFlow, Keras and
the package once, then forks a child per tool (the fork happens before any TensorFlow
runtime starts, so each child starts its own), which saves each tool the seconds of those
imports, and whatever a tool sets (Keras policies, grappler options) dies with its
child. TensorFlow's C++ log level is set to INFO for that one import, as
``compare_with_grappler.py`` needs grappler's summary lines.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = sorted((ROOT / "tools").glob("*.py"))
CANNOT_RUN = 77
TIMEOUT_S = 600  # one tool's smoke run
# Tools whose --smoke another branch of this round adds (its owner): until that branch is
# merged they are not run, and then this test says their entry must go.
AWAITING_SMOKE: dict[str, str] = {}
# More arguments for a tool's smoke run, ``{folder}`` the fixture's folder (kept for the tests):
# bench_fp8_gpu.py dumps its HLO there, which a test below counts.
SMOKE_ARGUMENTS: dict[str, tuple[str, ...]] = {"bench_fp8_gpu.py": ("--dump", "{folder}/fp8_hlo")}

RUNNER = r'''
import json, os, runpy, subprocess, sys, tempfile, time, traceback
from pathlib import Path

root, results, timeout = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # read once, at TensorFlow's first log line: grappler's INFO summaries
import numpy, sklearn, tensorflow, keras, amp_rewrite  # noqa: the imports every tool shares
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"  # what the tools' own subprocesses get

IGNORED = ("__pycache__", ".pytest_cache")


def checkout_state():
    listed = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=root, capture_output=True, text=True,
                            check=True).stdout
    return {line for line in listed.splitlines() if not any(name in line for name in IGNORED)}


def child(tool, log, tmp, extra):
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ["TMPDIR"] = str(tmp)
        tempfile.tempdir = None
        sys.argv, sys.path[0] = [str(tool), "--smoke", *extra], str(tool.parent)
        try:
            runpy.run_path(str(tool), run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # the child's top level: shown as Python shows it, then exit 1 (never the runner's loop)
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


for line in sys.stdin:
    tool, log, tmp, *extra = line.rstrip("\n").split("\t")
    tool, log, tmp = Path(tool), Path(log), Path(tmp)
    before, started = checkout_state(), time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(tool, log, tmp, extra)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() - started > timeout:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            code = "timed out"
            break
        time.sleep(0.05)
    wrote = sorted(checkout_state() ^ before)
    with results.open("a") as out:
        out.write(json.dumps({"tool": tool.name, "code": code, "seconds": time.monotonic() - started,
                              "wrote": wrote}) + "\n")
'''


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every tool's smoke run: tool name -> {"code", "seconds", "wrote", "log", "folder"}."""
    folder = tmp_path_factory.mktemp("tools")
    results = folder / "results.jsonl"
    # Each tool's TMPDIR is short, in the system's temporary directory: Chromium puts a Unix
    # socket there, whose path may not exceed 107 bytes (pytest's own folders can).
    temporary = Path(tempfile.mkdtemp(prefix="amp-smoke-"))
    lines = []
    for tool in TOOLS:
        if tool.name not in AWAITING_SMOKE:
            (temporary / tool.stem).mkdir()
            extra = (argument.format(folder=folder) for argument in SMOKE_ARGUMENTS.get(tool.name, ()))
            lines.append("\t".join([str(tool), str(folder / f"{tool.stem}.log"), str(temporary / tool.stem), *extra])
                         + "\n")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    try:
        subprocess.run([sys.executable, "-c", RUNNER, str(ROOT), str(results), str(TIMEOUT_S)], input="".join(lines),
                       cwd=ROOT, env=environ, text=True, timeout=TIMEOUT_S * len(lines), check=False)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    runs = {}
    for line in results.read_text(encoding="utf-8").splitlines() if results.exists() else ():
        run = json.loads(line)
        runs[run["tool"]] = {**run, "log": (folder / f"{Path(run['tool']).stem}.log").read_text(errors="replace"),
                             "folder": folder}
    return runs


@pytest.mark.parametrize("tool", TOOLS, ids=[tool.name for tool in TOOLS])
def test_the_tool_runs_in_its_smoke_mode(tool: Path, smoke_runs: dict[str, dict]) -> None:
    if tool.name in AWAITING_SMOKE:
        if "--smoke" in tool.read_text(encoding="utf-8"):
            pytest.fail(f"{tool.name} has --smoke now: delete its entry in AWAITING_SMOKE")
        pytest.xfail(f"{tool.name} gets --smoke from branch {AWAITING_SMOKE[tool.name]}")
    assert tool.name in smoke_runs, f"{tool.name}: the runner never reported it (it died before)"
    run = smoke_runs[tool.name]
    output = run["log"][-6000:]
    if run["code"] == CANNOT_RUN:
        pytest.skip(f"{tool.name} cannot run here: {(output.strip().splitlines() or ['(no reason)'])[-1]}")
    assert run["code"] == 0, f"{tool.name} --smoke exited {run['code']} after {run['seconds']:.0f} s:\n{output}"
    assert not run["wrote"], f"{tool.name} --smoke wrote into the checkout: {run['wrote']}"


def test_the_fp8_gpu_check_runs_its_whole_path_on_tiny_models_with_smoke(smoke_runs: dict[str, dict]) -> None:
    """Rule: tools/bench_fp8_gpu.py --smoke builds, calibrates, rewrites, dumps HLO and times all
    three variants on the CPU (inference rows; the training rows' XLA compiles take minutes on a
    CPU). The fixture's smoke run is the one checked: a second run in a process of its own, as
    tests/test_float8.py had, costs 20 s and checks nothing more."""
    run = smoke_runs["bench_fp8_gpu.py"]
    if run["code"] == CANNOT_RUN:
        pytest.skip(f"bench_fp8_gpu.py cannot run here: {(run['log'].strip().splitlines() or ['(no reason)'])[-1]}")
    assert run["code"] == 0, run["log"][-2000:]
    rows = [line for line in run["log"].splitlines() if line.startswith("| ") and "x |" in line]
    assert [row.split(" | ")[:2] for row in rows] == [["| " + m, v] for m in ("bert", "mlp")
                                                       for v in ("float32", "float16", "float8")]
    assert sorted(p.name for p in (run["folder"] / "fp8_hlo").iterdir()) == sorted(
        f"{m}-{v}.txt" for m in ("bert", "mlp") for v in ("float32", "float16", "float8"))


def test_the_gpu_script_refuses_in_one_line_without_a_gpu(tmp_path: Path) -> None:
    """``tools/bench_gpu.sh`` (not Python: no --smoke) where nvidia-smi fails says so in one
    line and exits 2 before it installs anything (an nvidia-smi that fails is put first on
    PATH, so a GPU machine runs this too)."""
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n", encoding="utf-8")
    (tmp_path / "nvidia-smi").chmod(0o755)
    process = subprocess.run(["bash", str(ROOT / "tools" / "bench_gpu.sh")], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert (process.returncode, process.stderr.splitlines()) == (2, [
        "bench_gpu.sh: no NVIDIA GPU here (nvidia-smi missing or failing); for the CPU run 'make bench'"])


def test_the_gpu_script_names_files_and_flags_that_exist() -> None:
    """What the GPU script cannot show on a CPU: it parses (``bash -n``), the checkout files it
    tests (its install stamp's trigger) exist, and each tools/X.py flag it passes is one that
    tool's parser takes — a renamed file or flag fails here, not on a lent GPU."""
    script = (ROOT / "tools" / "bench_gpu.sh").read_text(encoding="utf-8")
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    for named in re.findall(r"\|\| ([\w.]+) -nt", script):
        assert (ROOT / named).is_file(), f"bench_gpu.sh tests {named}, which is not in the checkout"
    commands = re.findall(r"(tools/\w+\.py)((?:[ \t]+[^\s$]+|[ \t]*\\\n)*)", script)
    assert len(commands) >= 2
    helps: dict[str, str] = {}  # each tool's --help, asked once (a TensorFlow import each)
    for tool, arguments in commands:
        if tool not in helps:
            helped = subprocess.run([sys.executable, str(ROOT / tool), "--help"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
            assert helped.returncode == 0, helped.stderr[-2000:]
            helps[tool] = helped.stdout
        for flag in re.findall(r"(?<!\S)(--[\w-]+)", arguments):
            assert re.search(rf"(?<![\w-]){flag}(?![\w-])", helps[tool]), f"bench_gpu.sh passes {tool} {flag}"
