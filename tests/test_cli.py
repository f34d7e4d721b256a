"""``amp-rewrite`` end to end: real SavedModels and GraphDef files on disk, the CLI run
in-process (``cli.main``) and, where exit codes and stderr matter, as a real process.

Every error case checks the CLI's contract: exit 2, exactly one ``amp-rewrite: error:``
line naming the file or node, no traceback, the source byte-identical, and nothing
(no partial destination, no temporary directory) left beside the destination.
"""
from __future__ import annotations

import contextlib
import io
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.framework import function_pb2, graph_pb2, types_pb2
from tensorflow.core.protobuf import saved_model_pb2

import amp_rewrite
from amp_rewrite import cli
from amp_rewrite.calibration import savedmodel, staging
from amp_rewrite.cli import options
from amp_rewrite.errors import tensorflow_cause

from cli_models import (
    ASSET_TEXT, EMBEDDING_ROWS, GRAPH_FETCHES, OVERFLOW_FETCH, TWO_TAG_SETS, export_keras_model,
    graph_def_with_deny_path, hash_tree, overflow_graph_def, save_embedding_module, save_module,
    save_string_module, save_tf1_text_model, save_two_tag_model, save_unbounded_gather_module,
    save_vocabulary_module, two_output_graph_def,
    write_graph_def,
)

from conftest import TARGET_TO_DTYPE, TARGET_TO_TOLERANCE, TARGETS
from forks import Forks

MODELS = ("keras", "module")
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
UNKNOWN_DIM = 3


Paths = dict[str, Path]


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for ``amp-rewrite`` as a process: this checkout's package first, and
    TensorFlow's native logging left at its default (the command must quiet it itself)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {**env, **extra}


def run_cli(*args: object) -> Run:
    """``amp-rewrite ARGS`` in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as exit_:  # argparse usage errors
            code = exit_.code
    return Run(code, out.getvalue(), err.getvalue())


def error_line(run: Run, code: int = 2) -> str:
    """The one error line of a failed run (asserting the exit code and that it is alone)."""
    assert run.code == code, f"exit {run.code}, expected {code}; stderr: {run.err!r}; stdout: {run.out!r}"
    assert "Traceback" not in run.err
    prefix = "amp-rewrite: error: " if code == 2 else "amp-rewrite: "
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), f"stderr is not one error line: {run.err!r}"
    return lines[0]


def assert_ok(run: Run) -> None:
    assert run.code == 0, f"exit {run.code}; stderr: {run.err!r}"


def listing(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


# --------------------------------------------------------------------------------------
# Models on disk, built once


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def forks() -> Iterator[Forks]:
    """TensorFlow's ``saved_model_cli``, each run a fork of one process that imported TensorFlow
    (tests/forks.py): 7 s of CPU saved per run, seven runs."""
    server = Forks(dict(os.environ))
    yield server
    server.close()


@pytest.fixture(scope="module")
def saved_models(workspace: Path) -> dict[str, Path]:
    source = workspace / "src"
    source.mkdir()
    export_keras_model(source / "keras")
    save_module(source / "module")
    return {"keras": source / "keras", "module": source / "module"}


@pytest.fixture(scope="module")
def graph_files(workspace: Path) -> dict[str, Path]:
    source = workspace / "graphs"
    source.mkdir()
    graph_def = graph_def_with_deny_path()
    return {
        ".pb": write_graph_def(graph_def, source / "graph.pb"),
        ".pbtxt": write_graph_def(graph_def, source / "graph.pbtxt"),
        "overflow": write_graph_def(overflow_graph_def(), source / "overflow.pb"),
    }


@dataclass(frozen=True)
class Conversion:
    src: Path
    dst: Path
    run: Run
    src_before: dict[str, str]
    src_after: dict[str, str]
    parent_after: set[str]


Conversions = dict[tuple[str, str], Conversion]
Loader = Callable[[Path], Any]


@pytest.fixture(scope="module")
def conversions(workspace: Path, saved_models: Paths) -> Conversions:
    """Each SavedModel converted to each target, in-process, into its own empty folder."""
    result = {}
    for model, src in saved_models.items():
        for target in TARGETS:
            parent = workspace / "out" / f"{model}-{target}"
            parent.mkdir(parents=True)
            before = hash_tree(src)
            run = run_cli("convert", src, parent / "dst", "--target", target)
            result[(model, target)] = Conversion(src, parent / "dst", run, before, hash_tree(src), listing(parent))
    return result


@pytest.fixture(scope="module")
def loaded() -> Loader:
    """``tf.saved_model.load``, once per path."""
    cache: dict[Path, Any] = {}

    def load(path: Path) -> Any:
        if path not in cache:
            cache[path] = tf.saved_model.load(str(path))
        return cache[path]

    return load


def converted(conversions: Conversions, model: str, target: str) -> Conversion:
    conversion = conversions[(model, target)]
    assert_ok(conversion.run)
    return conversion


def sample_inputs(function: Any, rng: np.random.Generator) -> dict[str, tf.Tensor]:
    """Random float32 inputs for a signature (unknown dims become 3)."""
    specs = function.structured_input_signature[1]
    return {
        name: tf.constant(rng.standard_normal([UNKNOWN_DIM if d is None else d for d in spec.shape]).astype(np.float32))
        for name, spec in specs.items()
    }


def library_of(saved_model_dir: Path) -> function_pb2.FunctionDefLibrary:
    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((saved_model_dir / "saved_model.pb").read_bytes())
    return saved_model.meta_graphs[0].graph_def.library


# --------------------------------------------------------------------------------------
# 1. SavedModels: convert


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", MODELS)
def test_convert_leaves_source_byte_identical_and_no_temp_dir(
    conversions: Conversions, model: str, target: str
) -> None:
    """The source is only read (even when the rewrite fails); the staging directory beside
    DST is gone after the rename."""
    assert conversions[(model, target)].src_after == conversions[(model, target)].src_before
    conversion = converted(conversions, model, target)
    assert conversion.parent_after == {"dst"}
    assert f"Wrote {conversion.dst}" in conversion.run.out
    assert conversion.run.err == ""


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", MODELS)
def test_converted_savedmodel_keeps_signatures_and_numbers(
    conversions: Conversions, loaded: Loader, model: str, target: str
) -> None:
    """Same signature keys, input/output names, dtypes and shapes; outputs within tolerance."""
    conversion = converted(conversions, model, target)
    old, new = loaded(conversion.src), loaded(conversion.dst)
    assert sorted(new.signatures) == sorted(old.signatures)
    rng = np.random.default_rng(1)
    tolerance = TARGET_TO_TOLERANCE[target]
    for key in sorted(old.signatures):
        old_fn, new_fn = old.signatures[key], new.signatures[key]
        assert new_fn.structured_input_signature == old_fn.structured_input_signature, key
        assert new_fn.structured_outputs == old_fn.structured_outputs, key
        feed = sample_inputs(old_fn, rng)
        want, got = old_fn(**feed), new_fn(**feed)
        assert sorted(got) == sorted(want)
        for name in want:
            expected, actual = want[name].numpy(), got[name].numpy()
            assert actual.dtype == expected.dtype == np.float32, f"{key}/{name}"
            scale = float(np.max(np.abs(expected)))
            np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * scale, err_msg=f"{key}/{name}")


@pytest.mark.parametrize("target", TARGETS)
def test_variable_only_function_returns_the_variable_exactly(
    conversions: Conversions, loaded: Loader, target: str
) -> None:
    """A signature without inputs that reads a variable has nothing to convert."""
    conversion = converted(conversions, "module", target)
    want = loaded(conversion.src).signatures["weights"]()["output_0"].numpy()
    got = loaded(conversion.dst).signatures["weights"]()["output_0"].numpy()
    np.testing.assert_array_equal(got, want)


# Variables stored in the target dtype by default (tests/test_weights.py): those every reader reads through a cast.
STORED_LOW = {"keras": {"variables/0", "variables/1", "variables/2", "variables/3", "_all_variables/0",
                        "_all_variables/1", "_all_variables/2", "_all_variables/3"}, "module": {"w2"}}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", MODELS)
def test_converted_savedmodel_copies_assets_and_stores_variables_read_low_in_the_target_dtype(
        conversions: Conversions, model: str, target: str) -> None:
    """The assets byte for byte; the checkpoint's keys all there, those only converted ops
    read in the target dtype (Keras' two copies of each weight alike), the others as they were."""
    conversion = converted(conversions, model, target)
    assert hash_tree(conversion.dst / "assets") == hash_tree(conversion.src / "assets")
    old, new = (tf.train.load_checkpoint(str(p / "variables" / "variables")).get_variable_to_dtype_map()
                for p in (conversion.src, conversion.dst))
    assert set(new) == set(old) and len(new) > 1
    low = {key.removesuffix("/.ATTRIBUTES/VARIABLE_VALUE") for key, dtype in new.items() if dtype != old[key]}
    assert low == STORED_LOW[model]
    assert {new[key] for key in new if key.removesuffix("/.ATTRIBUTES/VARIABLE_VALUE") in low} == {
        tf.as_dtype(TARGET_TO_DTYPE[target])}
    if model == "module":
        assets = list((conversion.dst / "assets").iterdir())
        assert [a.read_text(encoding="utf-8") for a in assets] == [ASSET_TEXT]


@pytest.mark.parametrize("model", MODELS)
def test_converted_savedmodel_has_fresh_fingerprint(conversions: Conversions, model: str) -> None:
    """fingerprint.pb hashes the new saved_model.pb and the new checkpoint, not the old ones."""
    from tensorflow.core.protobuf import fingerprint_pb2
    from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting as fingerprinting_pywrap

    conversion = converted(conversions, model, "float16")
    old = tf.saved_model.experimental.read_fingerprint(str(conversion.src))
    new = tf.saved_model.experimental.read_fingerprint(str(conversion.dst))
    assert new.saved_model_checksum != old.saved_model_checksum
    assert new.checkpoint_hash != old.checkpoint_hash  # weights stored float16
    fresh = fingerprint_pb2.FingerprintDef.FromString(fingerprinting_pywrap.CreateFingerprintDef(str(conversion.dst)))
    assert (new.saved_model_checksum, new.checkpoint_hash) == (fresh.saved_model_checksum, fresh.checkpoint_hash)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model", MODELS)
def test_converted_function_bodies_compute_matmul_and_conv_in_target_dtype(
    conversions: Conversions, model: str, target: str
) -> None:
    """Every float32 MatMul/Conv2D of the source's function bodies is in the target dtype."""
    conversion = converted(conversions, model, target)
    wanted = {"module": {"MatMul"}, "keras": {"MatMul", "Conv2D"}}[model]

    def heavy_ops(library: function_pb2.FunctionDefLibrary, dtype: int) -> set[tuple[str, str, str]]:
        return {(f.signature.name, n.name, n.op) for f in library.function for n in f.node_def
                if n.op in wanted and n.attr["T"].type == dtype}

    before = heavy_ops(library_of(conversion.src), types_pb2.DT_FLOAT)
    assert {op for _, _, op in before} == wanted
    assert heavy_ops(library_of(conversion.dst), TARGET_TO_DTYPE[target]) == before
    assert not heavy_ops(library_of(conversion.dst), types_pb2.DT_FLOAT)


@pytest.mark.parametrize("model", MODELS)
def test_saved_model_cli_shows_converted_model(conversions: Conversions, model: str, forks: Forks) -> None:
    """TensorFlow's own tool reads the result (both targets, run side by side)."""
    dsts = [converted(conversions, model, target).dst for target in TARGETS]
    processes = [
        subprocess.Popen(forks.script(BIN / "saved_model_cli", "show", "--all", "--dir", dst),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for dst in dsts
    ]
    for dst, process in zip(dsts, processes):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, f"saved_model_cli failed on {dst}: {err[-2000:]}"
        assert "signature_def['serving_default']" in out


# --------------------------------------------------------------------------------------
# 2. Validation


def test_validate_prints_every_output_and_exits_0(workspace: Path, saved_models: Paths) -> None:
    run = run_cli("convert", saved_models["module"], workspace / "validated", "--validate", 2)
    assert_ok(run)
    assert "Validation (2 run(s) of random inputs, which are not the model's data: a pass or a failure here says" \
        " little about real inputs (pass them with --inputs FILE.npz); p99-rel, tolerance 0.01):" in run.out
    for output in ("serving_default/y", "other/out", "weights/output_0"):
        line = next((l for l in run.out.splitlines() if f" {output}:" in l), None)
        assert line is not None and line.split()[0] == "ok" and "p99-rel" in line, f"{output}: {run.out}"


def test_validate_fails_when_overlay_allows_an_overflowing_exp(workspace: Path, graph_files: Paths) -> None:
    """exp(>11) overflows float16: fine while Exp/Sum are deny ops, exit 1 once an overlay allows them."""
    overlay = workspace / "allow_exp.yaml"
    overlay.write_text("allow: {add: [Exp, Sum]}\ndeny: {remove: [Exp, Sum]}\n", encoding="utf-8")
    common = ("--fetch", OVERFLOW_FETCH, "--validate", 2)
    safe = run_cli("convert", graph_files["overflow"], workspace / "overflow-safe.pb", *common)
    assert_ok(safe)
    run = run_cli("convert", graph_files["overflow"], workspace / "overflow-allowed.pb", "--lists", overlay, *common)
    assert "validation failed for 1 output(s)" in error_line(run, code=1)
    assert any(l.split()[:2] == ["FAIL", f"graph/{OVERFLOW_FETCH}:"] for l in run.out.splitlines()), run.out


def test_validate_compares_the_fetched_output_port(workspace: Path) -> None:
    """--fetch pair:1 validates output 1 of pair; output 0 overflows float16 and fails."""
    source = write_graph_def(two_output_graph_def(), workspace / "two_outputs.pb")
    second = run_cli("convert", source, workspace / "port1.pb", "--fetch", "pair:1", "--validate", 2)
    assert_ok(second)
    assert any(l.split()[:2] == ["ok", "graph/pair:1:"] for l in second.out.splitlines()), second.out
    first = run_cli("convert", source, workspace / "port0.pb", "--fetch", "pair:0", "--validate", 2)
    assert "validation failed for 1 output(s)" in error_line(first, code=1)
    assert any(l.split()[:2] == ["FAIL", "graph/pair:0:"] for l in first.out.splitlines()), first.out


def test_a_placeholder_nothing_reads_needs_no_array(workspace: Path) -> None:
    """A frozen graph can hold placeholders nothing reads (TensorFlow's freezing of a loop
    leaves ``unused_control_flow_input`` ones): --inputs without them validates the fetched
    output; a placeholder the output does read is still asked for by name."""
    graph_def = two_output_graph_def()
    unused = graph_def.node.add(name="unused_control_flow_input", op="Placeholder")
    unused.attr["dtype"].type = types_pb2.DT_FLOAT
    source = write_graph_def(graph_def, workspace / "unused_placeholder.pb")
    inputs = workspace / "x_only.npz"
    np.savez(inputs, x=np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32))
    run = run_cli("convert", source, workspace / "unused_placeholder_out.pb", "--fetch", "pair:1", "--inputs", inputs)
    assert_ok(run)
    assert any(l.split()[:2] == ["ok", "graph/pair:1:"] for l in run.out.splitlines()), run.out
    empty = workspace / "nothing.npz"
    np.savez(empty, other=np.zeros(1, np.float32))
    lacking = run_cli("convert", source, workspace / "lacking.pb", "--fetch", "pair:1", "--inputs", empty)
    assert "no array for placeholder(s) x" in error_line(lacking, code=2)


def test_inputs_npz_feeds_every_signature(workspace: Path, saved_models: Paths) -> None:
    inputs = workspace / "inputs.npz"
    rng = np.random.default_rng(2)
    np.savez(inputs, x=rng.standard_normal((2, 5)).astype(np.float32),
             z=rng.standard_normal((2, 16)).astype(np.float32))
    run = run_cli("convert", saved_models["module"], workspace / "with-inputs", "--inputs", inputs)
    assert_ok(run)
    assert f"Validation ({inputs}; p99-rel" in run.out and "serving_default/y" in run.out
    assert "random inputs" not in run.out


def test_inputs_npz_missing_an_array_names_it(workspace: Path, saved_models: Paths) -> None:
    inputs = workspace / "only_x.npz"
    np.savez(inputs, x=np.ones((2, 5), np.float32))
    run = run_cli("convert", saved_models["module"], workspace / "missing-z", "--validate", 1, "--inputs", inputs)
    line = error_line(run)
    assert "'z'" in line or " z " in line or line.endswith(" z"), line
    assert "only_x.npz" in line
    assert not (workspace / "missing-z").exists(), "a bad --inputs file must stop the run before DST is written"


def test_process_exit_1_on_huge_inputs_with_one_quiet_stderr_line(workspace: Path, saved_models: Paths) -> None:
    """The installed ``amp-rewrite``: 1e5 is inf in float16, so validation fails; stderr holds
    the one error line (saying nothing was written) and none of TensorFlow's native start-up
    chatter. Validation runs before the result is moved into place, so a rerun is not blocked."""
    inputs = workspace / "huge.npz"
    np.savez(inputs, x=np.full((2, 5), 1e5, np.float32), z=np.full((2, 16), 1e5, np.float32))
    dst = workspace / "huge-out"
    process = subprocess.run(
        [str(BIN / "amp-rewrite"), "convert", str(saved_models["module"]), str(dst), "--inputs", str(inputs)],
        check=False, capture_output=True, text=True, env=cli_env(), timeout=300,
    )
    assert process.returncode == 1, process.stderr
    assert process.stderr.splitlines() == [
        f"amp-rewrite: validation failed for 2 output(s); see above; nothing was written to {dst}"
        " (--keep-failed writes it anyway)"]
    assert "FAIL serving_default/y" in process.stdout and "FAIL other/out" in process.stdout
    assert not dst.exists() and not list(workspace.glob(".huge-out.*"))


# --------------------------------------------------------------------------------------
# 3. GraphDef files


def read_graph_def(path: Path) -> graph_pb2.GraphDef:
    graph_def = graph_pb2.GraphDef()
    if path.suffix == ".pbtxt":
        text_format.Parse(path.read_text(encoding="utf-8"), graph_def)
    else:
        graph_def.ParseFromString(path.read_bytes())
    return graph_def


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("suffix", [".pb", ".pbtxt"])
def test_graph_def_file_equals_rewrite_graph_def(workspace: Path, graph_files: Paths, suffix: str, target: str) -> None:
    """convert --fetch writes what the Python API returns, in the source's format (with
    --float32-weights: by default its Const weights are also stored low, tests/test_weights.py)."""
    src = graph_files[suffix]
    before = hash_tree(src)
    dst = workspace / f"graph-{target}{suffix}"
    fetches = [a for f in GRAPH_FETCHES for a in ("--fetch", f)]
    assert_ok(run_cli("convert", src, dst, "--target", target, *fetches, "--float32-weights"))
    expected = amp_rewrite.rewrite_graph_def(read_graph_def(src), target=target, fetches=GRAPH_FETCHES).graph_def
    written = read_graph_def(dst)  # a text file for .pbtxt, binary for .pb
    assert written == expected
    assert {n.name: n.attr["T"].type for n in written.node}["allow1"] == TARGET_TO_DTYPE[target]
    assert hash_tree(src) == before


def test_graph_def_destination_suffix_matches_its_contents(workspace: Path, graph_files: Paths) -> None:
    """The destination's suffix says the format: a .pb source written to a .pbtxt
    destination is written as text (and a .pbtxt source to a .pb as binary), the rewrite
    the same either way (--float32-weights: the Python API's graph, Const weights as they were)."""
    for source, dst in ((graph_files[".pb"], workspace / "cross-kind.pbtxt"),
                        (graph_files[".pbtxt"], workspace / "cross-kind.pb")):
        assert_ok(run_cli("convert", source, dst, "--fetch", "Identity", "--float32-weights"))
        expected = amp_rewrite.rewrite_graph_def(read_graph_def(source), target="float16",
                                                 fetches=["Identity"]).graph_def
        if dst.suffix == ".pbtxt":
            assert text_format.Parse(dst.read_text(encoding="utf-8"), graph_pb2.GraphDef()) == expected
        else:
            assert graph_pb2.GraphDef.FromString(dst.read_bytes()) == expected


def test_keep_regex_keeps_matching_nodes_float32(workspace: Path, graph_files: Paths) -> None:
    dst = workspace / "kept.pb"
    run = run_cli("convert", graph_files[".pb"], dst, "--keep", "allow[0-9]")
    assert_ok(run)
    assert "keep-nodes 1" in next(line for line in run.out.splitlines() if line.startswith("Stayed float32")), run.out
    name_to_dtype = {n.name: n.attr["T"].type for n in read_graph_def(dst).node}
    assert name_to_dtype["allow1"] == types_pb2.DT_FLOAT
    assert name_to_dtype["odd"] == types_pb2.DT_HALF


# --------------------------------------------------------------------------------------
# 4. inspect and explain


def test_inspect_all_prints_a_row_per_function_and_the_summary(saved_models: Paths) -> None:
    """--all: every item, its counts as the report has them; the casts column is the one cast
    count the summary line sums (casts to the target, excluding Const and Variable casts)."""
    src = saved_models["module"]
    run = run_cli("inspect", src, "--all")
    assert_ok(run)
    rows = run.out.splitlines()
    lists = amp_rewrite.load_lists("float16")
    report = savedmodel.rewrite_model(savedmodel.read_model(src), target="float16", lists=lists).report
    names = sorted([f.signature.name for f in library_of(src).function] + ["(main graph)"])
    name_to_row = {row.split("  ")[0]: row.split() for row in rows if row.split("  ")[0] in names}
    assert sorted(name_to_row) == names, run.out
    for item in report.items:
        row = name_to_row[item.function or "(main graph)"]
        counts = row[2:5] if item.function == "" else row[1:4]  # "(main graph)" is two words
        assert counts == [str(item.nodes_before), str(item.vertices_converted), str(item.casts_to_target)], row
    assert sum(int(r[4] if n == "(main graph)" else r[3]) for n, r in name_to_row.items()) == report.casts_to_target
    assert report.summary() in rows


def test_inspect_separates_the_model_from_tensorflow_plumbing(saved_models: Paths) -> None:
    """By default the table lists the model's own functions (serve, other, weights); the
    save/restore functions, signature wrappers and the loader's main graph are one line;
    the model headline sums the rows shown."""
    run = run_cli("inspect", saved_models["module"])
    assert_ok(run)
    lines = run.out.splitlines()
    table = [l.split() for l in lines[2:] if l.startswith("__inference")]
    assert sorted(r[0].rsplit("_", 1)[0] for r in table) == ["__inference_other", "__inference_serve",
                                                             "__inference_weights"], run.out
    converted, nodes, casts = (sum(int(r[i]) for r in table) for i in (2, 1, 3))
    assert f"Model: converted {converted}/{nodes} nodes to float16 using {casts} cast(s)" in run.out
    plumbing = next(l for l in lines if l.startswith("TensorFlow's plumbing"))
    for kind in ("save/restore 2", "signature wrapper 3", "loader graph 1"):
        assert kind in plumbing, plumbing


def test_inspect_hints_tensor_cores_for_dims_not_multiple_of_8(saved_models: Paths) -> None:
    """serve: (N×5)·(5×3) gets a hint; other: (N×16)·(16×16) does not; bfloat16 has none."""
    src = saved_models["module"]
    library = [f.signature.name for f in library_of(src).function]
    serve = next(name for name in library if name.startswith("__inference_serve_"))
    other = next(name for name in library if name.startswith("__inference_other_"))
    run = run_cli("inspect", src)
    assert_ok(run)
    hints = run.out.split("Tensor Core hints", 1)[1].splitlines()[1:] if "Tensor Core hints" in run.out else []
    assert any(h.strip().startswith(f"{serve}:") and "MatMul" in h for h in hints), run.out
    assert not any(other in h for h in hints), run.out
    bf16 = run_cli("inspect", src, "--target", "bfloat16")
    assert_ok(bf16)
    assert "Tensor Core" not in bf16.out


def test_inspect_hints_tensor_cores_in_a_graph_def_file(graph_files: Paths) -> None:
    """A tf.function's GraphDef has static shapes (placeholder, constants) but no
    ``_output_shapes`` attrs: 'odd' (16×12) still deserves a hint, 'allow1' (16×16) none."""
    run = run_cli("inspect", graph_files[".pb"], "--fetch", "Identity", "--fetch", "Identity_1")
    assert_ok(run)
    hints = run.out.split("Tensor Core hints", 1)[1].splitlines()[1:] if "Tensor Core hints" in run.out else []
    assert any(h.strip().startswith("odd ") for h in hints), run.out
    assert not any("allow1" in h for h in hints), run.out


def test_explain_converted_node(graph_files: Paths) -> None:
    run = run_cli("explain", graph_files[".pb"], "allow1", "--fetch", "Identity")
    assert_ok(run)
    lines = [l.strip() for l in run.out.splitlines()]
    assert lines[0].startswith("allow1 (MatMul)") and lines[0].endswith("float32 -> float16"), run.out
    assert any(l.startswith("rule: ") for l in lines) and any(l.startswith("why: ") and "MatMul" in l for l in lines)


def test_explain_deny_propagated_node_shows_path_from_deny_op(graph_files: Paths) -> None:
    run = run_cli("explain", graph_files[".pb"], "deny2", "--fetch", "Identity")
    assert_ok(run)
    assert run.out.splitlines()[0].endswith("float32 -> float32"), run.out
    paths = [l.strip() for l in run.out.splitlines() if l.strip().startswith("path: ")]
    assert len(paths) == 1, run.out
    hops = paths[0].removeprefix("path: ").split(" -> ")
    assert (hops[0], hops[-1]) == ("deny1", "deny2")


def test_explain_kept_node_shows_rule_and_reason_and_its_downstream_deny(workspace: Path, graph_files: Paths) -> None:
    """A node kept by an overlay's keep_nodes mapping: explain gives rule keep-nodes and the
    entry's reason; clr1, between it and the deny op deny1, is denied from it (a kept node
    acts as a deny op), with the path. ``--keep`` entries have no reason: explain names the entry."""
    overlay = workspace / "keep-reasons.yaml"
    reason = "calibration: output 0 reached 2.1e+05, over float16's safe magnitude 1.6e+04"
    overlay.write_text(f'keep_nodes:\n  allow1: "{reason}"\n', encoding="utf-8")
    run = run_cli("explain", graph_files[".pb"], "allow1", "--fetch", "Identity", "--lists", overlay)
    assert_ok(run)
    lines = [line.strip() for line in run.out.splitlines()]
    assert lines[0].endswith("float32 -> float32") and lines[1:3] == ["rule: keep-nodes", f"why:  {reason}"], run.out
    run = run_cli("explain", graph_files[".pb"], "clr1", "--fetch", "Identity", "--lists", overlay)
    assert_ok(run)
    lines = [line.strip() for line in run.out.splitlines()]
    assert lines[1:] == ["rule: deny-propagation", "why:  downstream of kept node 'allow1' through clear/infer ops",
                         "path: allow1 -> clr1"], run.out

    run = run_cli("explain", graph_files[".pb"], "allow1", "--fetch", "Identity", "--keep", "allow[0-9]")
    assert_ok(run)
    assert "why:  matches keep_nodes entry 'allow[0-9]'" in run.out, run.out


def test_explain_unknown_node_exits_2_naming_it(graph_files: Paths) -> None:
    line = error_line(run_cli("explain", graph_files[".pb"], "no_such_node"))
    assert "'no_such_node'" in line


def test_explain_node_in_several_functions_asks_for_function(saved_models: Paths) -> None:
    src = saved_models["module"]
    line = error_line(run_cli("explain", src, "MatMul"))
    assert "--function" in line and "'MatMul'" in line
    names = [f.signature.name for f in library_of(src).function]
    serve = next(name for name in names if name.startswith("__inference_serve_"))
    run = run_cli("explain", src, "MatMul", "--function", serve)
    assert_ok(run)
    assert f"in function '{serve}'" in run.out and "float32 -> float16" in run.out
    assert "'nope'" in error_line(run_cli("explain", src, "MatMul", "--function", "nope"))


# --------------------------------------------------------------------------------------
# dump


def test_dump_and_convert_dump_write_a_report(workspace: Path, graph_files: Paths) -> None:
    """``dump`` and ``convert --dump`` write report.html into the directory they are given."""
    directory = workspace / "dump"
    assert_ok(run_cli("dump", graph_files[".pb"], directory, "--fetch", "Identity"))
    assert (directory / "report.html").is_file()
    converted_dir = workspace / "convert-dump"
    run = run_cli("convert", graph_files[".pb"], workspace / "dumped.pb", "--dump", converted_dir)
    assert_ok(run)
    assert (converted_dir / "report.html").is_file() and (workspace / "dumped.pb").is_file()


# --------------------------------------------------------------------------------------
# 5. Bad input: exit 2, one line, source untouched, nothing left beside the destination


def _corrupt(kind: str, saved_models: Paths, graph_files: Paths, folder: Path) -> tuple[Path, str]:
    """A broken source of ``kind`` in ``folder``, and what its error line must mention."""
    if kind == "missing":
        return folder / "nothing_here", "nothing_here"
    if kind == "empty-dir":
        (folder / "empty").mkdir()
        return folder / "empty", "empty"
    if kind in ("truncated", "random-bytes", "no-variables"):
        src = folder / kind
        shutil.copytree(saved_models["module"], src)
        pb = src / "saved_model.pb"
        if kind == "truncated":
            pb.write_bytes(pb.read_bytes()[:200])
        elif kind == "random-bytes":
            pb.write_bytes(np.random.default_rng(3).bytes(4096))
        else:
            shutil.rmtree(src / "variables")
            return src, "variables"
        return src, "saved_model.pb"
    graph_def = read_graph_def(graph_files[".pb"])
    if kind == "pbtxt-syntax":
        path = folder / "broken.pbtxt"
        path.write_text(text_format.MessageToString(graph_def)[:-60] + "\nnode { name: ", encoding="utf-8")
        return path, "broken.pbtxt"
    node = next(n for n in graph_def.node if n.name == "clr1")
    if kind == "dangling-input":
        node.input[0] = "ghost:0"
    else:  # unknown-op
        node.op = "NoSuchOp"
    return write_graph_def(graph_def, folder / f"{kind}.pb"), "clr1"


BAD_SOURCES = ("missing", "empty-dir", "truncated", "random-bytes", "no-variables", "pbtxt-syntax",
               "dangling-input", "unknown-op")


@pytest.mark.parametrize("kind", BAD_SOURCES)
def test_bad_source_exits_2_with_one_line(workspace: Path, saved_models: Paths, graph_files: Paths, kind: str) -> None:
    folder = workspace / "bad" / kind
    folder.mkdir(parents=True)
    src, mention = _corrupt(kind, saved_models, graph_files, folder)
    before, entries = (hash_tree(src) if src.exists() else None), listing(folder)
    dst = folder / ("out" + (src.suffix if src.suffix in (".pb", ".pbtxt") else ""))
    line = error_line(run_cli("convert", src, dst))
    assert mention in line, line
    assert not dst.exists() and listing(folder) == entries
    assert (hash_tree(src) if src.exists() else None) == before


@pytest.mark.parametrize("overlay, mention", [
    ("allow: {add: [Exp]\n", "invalid YAML"),
    ("allow: {add: [Exp]}\n", "'Exp'"),   # Exp is also on the built-in deny list
    ("allow: {add: [Exp]}\nbogus: 1\n", "'bogus'"),
], ids=["syntax", "op-in-two-lists", "unknown-key"])
def test_bad_overlay_exits_2_naming_the_file(workspace: Path, graph_files: Paths, overlay: str, mention: str) -> None:
    folder = workspace / "overlay" / mention.strip("'").replace(" ", "-")
    folder.mkdir(parents=True)
    path = folder / "lists.yaml"
    path.write_text(overlay, encoding="utf-8")
    line = error_line(run_cli("convert", graph_files[".pb"], folder / "out.pb", "--lists", path))
    assert "lists.yaml" in line and mention in line, line
    assert listing(folder) == {"lists.yaml"}


def test_existing_destination_needs_force(workspace: Path, saved_models: Paths) -> None:
    folder = workspace / "force"
    dst = folder / "dst"
    dst.mkdir(parents=True)
    (dst / "old.txt").write_text("old", encoding="utf-8")
    line = error_line(run_cli("convert", saved_models["module"], dst))
    assert "--force" in line and str(dst) in line
    assert listing(dst) == {"old.txt"}
    assert_ok(run_cli("convert", saved_models["module"], dst, "--force"))
    assert "old.txt" not in listing(dst) and (dst / "saved_model.pb").is_file()
    assert listing(folder) == {"dst"}
    assert "serving_default" in tf.saved_model.load(str(dst)).signatures


@pytest.mark.parametrize("where", ["same", "inside"])
def test_destination_in_source_is_refused(workspace: Path, saved_models: Paths, where: str) -> None:
    src = workspace / f"own-{where}"
    shutil.copytree(saved_models["module"], src)
    before = hash_tree(src)
    dst = src if where == "same" else src / "variables" / "out"
    line = error_line(run_cli("convert", src, dst, "--force"))
    assert str(src.resolve()) in line
    assert hash_tree(src) == before


def test_destination_holding_the_source_is_refused(workspace: Path, saved_models: Paths) -> None:
    """``convert holder/model holder --force`` must not swap out (and delete) the folder the
    source lives in."""
    holder = workspace / "holder"
    src = holder / "model"
    shutil.copytree(saved_models["module"], src)
    before = hash_tree(src)
    run = run_cli("convert", src, holder, "--force")
    assert src.is_dir() and hash_tree(src) == before, "the source was deleted or changed"
    error_line(run)


@pytest.mark.parametrize("where", ["proc", "under-a-file"])
def test_unwritable_destination_exits_2(workspace: Path, saved_models: Paths, where: str) -> None:
    if where == "proc":
        dst = Path("/proc/amp_rewrite_cli_out")  # /proc is a directory nobody can create entries in
    else:
        blocker = workspace / "a_file"
        blocker.write_text("not a directory", encoding="utf-8")
        dst = blocker / "out"
    line = error_line(run_cli("convert", saved_models["module"], dst))
    assert str(dst.parent) in line
    assert not dst.exists()


class _FailingMoveIntoPlace:
    """``os.replace`` that fails (disk full) when the staged model is moved onto ``destination``
    and works otherwise, e.g. for moving an old destination aside."""

    def __init__(self, destination: Path) -> None:
        self.destination, self.real, self.failed = destination, os.replace, False

    def __call__(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        if Path(dst) == self.destination and Path(src).name == self.destination.name:
            self.failed = True
            raise OSError(28, "No space left on device", str(dst))
        self.real(src, dst)


def test_failed_rename_leaves_no_partial_destination(
    workspace: Path, saved_models: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = workspace / "half-way"
    folder.mkdir()
    failing = _FailingMoveIntoPlace(folder / "dst")
    monkeypatch.setattr(staging.os, "replace", failing)
    line = error_line(run_cli("convert", saved_models["module"], folder / "dst"))
    assert failing.failed and str(folder / "dst") in line
    assert listing(folder) == set()


def test_failed_forced_replace_keeps_the_old_destination(
    workspace: Path, saved_models: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --force the old DST is moved aside first; if the new one then cannot be moved in,
    the old one must come back (the message says "nothing was changed")."""
    folder = workspace / "half-way-force"
    dst = folder / "dst"
    dst.mkdir(parents=True)
    (dst / "old.txt").write_text("old", encoding="utf-8")
    failing = _FailingMoveIntoPlace(dst)
    monkeypatch.setattr(staging.os, "replace", failing)
    run = run_cli("convert", saved_models["module"], dst, "--force")
    assert failing.failed
    assert listing(folder) == {"dst"} and listing(dst) == {"old.txt"}, "the old destination was lost"
    error_line(run)


def test_process_exit_2_with_one_line_and_no_tensorflow_chatter(workspace: Path, saved_models: Paths) -> None:
    """``python -m amp_rewrite`` on a truncated saved_model.pb: a real exit code and one stderr line."""
    src = workspace / "truncated-for-process"
    shutil.copytree(saved_models["module"], src)
    (src / "saved_model.pb").write_bytes((src / "saved_model.pb").read_bytes()[:100])
    before = hash_tree(src)
    process = subprocess.run([sys.executable, "-m", "amp_rewrite", "convert", str(src), str(workspace / "never")],
                             check=False, capture_output=True, text=True, env=cli_env(), timeout=300)
    assert process.returncode == 2
    lines = process.stderr.splitlines()
    assert len(lines) == 1, process.stderr
    assert lines[0].startswith("amp-rewrite: error: ") and "saved_model.pb" in lines[0], process.stderr
    assert process.stdout == ""
    assert not (workspace / "never").exists() and hash_tree(src) == before


# --------------------------------------------------------------------------------------
# 6. Tag sets: the MetaGraphDef the user names is converted, the others are copied


def run_process(*args: object, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``python -m amp_rewrite ARGS`` as a process, from this checkout."""
    return subprocess.run([sys.executable, "-m", "amp_rewrite", *map(str, args)], check=False,
                          capture_output=True, text=True, env=cli_env(**env), timeout=timeout)


def process_error_line(process: subprocess.CompletedProcess) -> str:
    """The one stderr line of a process that exited 2."""
    assert process.returncode == 2, f"exit {process.returncode}; stderr: {process.stderr!r}"
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("amp-rewrite: error: "), process.stderr
    return lines[0]


def meta_graphs_of(saved_model_dir: Path) -> dict[str, Any]:
    """MetaGraphDefs by their tags (comma-joined)."""
    saved_model = saved_model_pb2.SavedModel()
    saved_model.ParseFromString((saved_model_dir / "saved_model.pb").read_bytes())
    return {",".join(meta.meta_info_def.tags): meta for meta in saved_model.meta_graphs}


def matmul_dtypes(meta: Any) -> list[int]:
    return [node.attr["T"].type for node in meta.graph_def.node if node.op == "MatMul"]


@pytest.fixture(scope="module")
def two_tag_model(workspace: Path) -> Path:
    path = workspace / "src" / "two_tags"
    save_two_tag_model(path)
    assert list(meta_graphs_of(path)) == list(TWO_TAG_SETS)
    return path


@pytest.mark.parametrize("tag_set", [None, *TWO_TAG_SETS])
def test_tag_set_chooses_the_meta_graph_converted_and_says_which(
    workspace: Path, two_tag_model: Path, tag_set: str | None, forks: Forks
) -> None:
    """Default ``serve`` (what TF Serving loads), although ``train`` comes first in the file;
    the other MetaGraphDef is byte-identical to the source's, and the output names both."""
    dst = workspace / f"two-tags-{tag_set}"
    process = run_process("convert", two_tag_model, dst, *(["--tag-set", tag_set] if tag_set else []))
    assert process.returncode == 0, process.stderr
    chosen = tag_set or "serve"
    other = next(t for t in TWO_TAG_SETS if t != chosen)
    assert f"MetaGraphDef '{chosen}': converted; '{other}': left as it was" in process.stdout
    before, after = meta_graphs_of(two_tag_model), meta_graphs_of(dst)
    assert matmul_dtypes(after[chosen]) == [types_pb2.DT_HALF]
    assert after[other].SerializeToString(deterministic=True) == before[other].SerializeToString(deterministic=True)
    shown = subprocess.run(forks.script(BIN / "saved_model_cli", "show", "--dir", dst, "--tag_set", chosen,
                                        "--signature_def", "serving_default"), capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and "DT_FLOAT" in shown.stdout, shown.stderr[-2000:]


def test_tag_set_missing_exits_2_naming_the_tag_sets_there(workspace: Path, two_tag_model: Path) -> None:
    dst = workspace / "two-tags-missing"
    line = process_error_line(run_process("convert", two_tag_model, dst, "--tag-set", "gpu,serve"))
    assert "'gpu,serve'" in line and "'train'" in line and "'serve'" in line and "--tag-set" in line, line
    assert not dst.exists()


def test_tag_set_validate_loads_the_chosen_meta_graph(workspace: Path, two_tag_model: Path) -> None:
    """tf.saved_model.load needs the tags of a two-MetaGraphDef SavedModel: --validate passes them."""
    process = run_process("convert", two_tag_model, workspace / "two-tags-validated", "--validate", 2)
    assert process.returncode == 0, process.stderr
    assert any(l.split()[:2] == ["ok", "serving_default/y:"] for l in process.stdout.splitlines()), process.stdout
    assert process.stderr == ""


# --------------------------------------------------------------------------------------
# 7. GraphDef outputs


def test_graph_def_without_fetch_keeps_its_sinks_dtypes_and_names_them(workspace: Path, graph_files: Paths) -> None:
    """Identity_1 reads the converted MatMul 'odd': as a sink it stays float32, so the file
    still returns float32."""
    dst = workspace / "sinks.pb"
    run = run_cli("convert", graph_files[".pb"], dst)
    assert_ok(run)
    assert "Outputs (no --fetch; the nodes nothing reads keep their dtypes): Identity, Identity_1" in run.out
    name_to_node = {n.name: n for n in read_graph_def(dst).node}
    assert name_to_node["odd"].attr["T"].type == types_pb2.DT_HALF
    assert name_to_node["Identity_1"].attr["T"].type == types_pb2.DT_FLOAT
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(read_graph_def(dst), name="")
    assert graph.get_tensor_by_name("Identity_1:0").dtype == tf.float32


@pytest.mark.parametrize("fetch, mention", [
    ("odd:1", "outputs 0..0"), ("^odd", "NAME:PORT"), ("odd:x", "NAME:PORT"), ("ghost", "no such node"),
], ids=["no-such-port", "control", "malformed", "no-such-node"])
def test_bad_fetch_exits_2_before_writing(workspace: Path, graph_files: Paths, fetch: str, mention: str) -> None:
    dst = workspace / f"bad-fetch-{fetch.replace('^', 'ctl').replace(':', '-')}.pb"
    line = error_line(run_cli("convert", graph_files[".pb"], dst, "--fetch", fetch))
    assert mention in line and fetch in line, line
    assert not dst.exists()


def test_validate_without_outputs_is_refused_before_writing(workspace: Path) -> None:
    """A graph whose only sink is a NoOp has nothing to compare."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 2], name="x")
        with tf.control_dependencies([tf.matmul(x, x, name="allow1")]):
            tf.no_op(name="done")
    source = write_graph_def(graph.as_graph_def(), workspace / "no_outputs.pb")
    dst = workspace / "no-outputs-out.pb"
    line = error_line(run_cli("convert", source, dst, "--validate", 1))
    assert "--fetch" in line and "no_outputs.pb" in line, line
    assert not dst.exists()


# --------------------------------------------------------------------------------------
# 8. Inputs checked before anything is written


@pytest.fixture(scope="module")
def input_models(workspace: Path) -> Paths:
    folder = workspace / "src" / "inputs"
    folder.mkdir(parents=True)
    save_embedding_module(folder / "embedding")
    save_string_module(folder / "text")
    save_vocabulary_module(folder / "vocabulary")
    save_tf1_text_model(folder / "tf1-text")
    save_unbounded_gather_module(folder / "gather")
    return {name: folder / name for name in ("embedding", "text", "vocabulary", "tf1-text", "gather")}


def test_float64_inputs_are_cast_with_a_note(workspace: Path, saved_models: Paths) -> None:
    """numpy's default dtype is float64: the arrays are cast to the signature's float32, said once each."""
    inputs = workspace / "float64.npz"
    rng = np.random.default_rng(4)
    np.savez(inputs, x=rng.standard_normal((2, 5)), z=rng.standard_normal((2, 16)))
    run = run_cli("convert", saved_models["module"], workspace / "from-float64", "--inputs", inputs)
    assert_ok(run)
    notes = [l for l in run.out.splitlines() if l.startswith("Note: float64.npz:") and "float64; cast to float32" in l]
    assert len(notes) == 2, run.out
    assert "ok   serving_default/y" in run.out


@pytest.mark.parametrize("arrays, mention", [
    ({"x": np.ones((2, 4), np.float32), "z": np.ones((2, 16), np.float32)}, "shape (2, 4)"),
    ({"x": np.array([["a"] * 5] * 2), "z": np.ones((2, 16), np.float32)}, "save it as float32"),
], ids=["wrong-shape", "strings-for-floats"])
def test_inputs_that_do_not_fit_exit_2_before_writing(
    workspace: Path, saved_models: Paths, arrays: dict[str, np.ndarray], mention: str
) -> None:
    inputs = workspace / f"misfit-{len(mention)}.npz"
    np.savez(inputs, **arrays)
    dst = workspace / f"misfit-out-{len(mention)}"
    line = error_line(run_cli("convert", saved_models["module"], dst, "--validate", 1, "--inputs", inputs))
    assert mention in line and "'x'" in line and "serving_default" in line, line
    assert not dst.exists()


def test_random_ids_are_drawn_within_the_embedding_they_index(workspace: Path, input_models: Paths) -> None:
    """The ids index a 3-row table: random ids are 0-2, said on the validation's inputs line,
    and the model validates with no --inputs (0-9, as before, fails on CPU)."""
    run = run_cli("convert", input_models["embedding"], workspace / "embedding-random", "--validate", 2)
    assert_ok(run)
    assert f"ids 0-{EMBEDDING_ROWS - 1} (bounded by table " in run.out and f"of {EMBEDDING_ROWS} rows)" in run.out
    assert "ok   serving_default/y" in run.out


def test_random_ids_no_table_bounds_say_which_input_and_to_pass_inputs(workspace: Path, input_models: Paths) -> None:
    """The ids pick columns of an input whose width the graph does not say: drawn 0-9 with a
    note naming them; the source fails on them, so the user is told to pass --inputs, in one
    line naming TensorFlow's cause (not its "Graph execution error" headline), and nothing
    is written. Calibration says the same. Real ids then validate."""
    dst = workspace / "gather-out"
    process = run_process("convert", input_models["gather"], dst, "--validate", 2)
    line = process_error_line(process)
    assert "Note: random inputs: ids feeds no table" in process.stdout and "--inputs FILE.npz" in process.stdout
    assert "--inputs" in line and "serving_default" in line and "(ids drawn 0-9 as no table bounds it;" in line, line
    assert re.search(r"\(indices\[0,\d\] = \d is not in \[0, 2\)\)$", line), line
    assert not dst.exists() and not list(workspace.glob(".gather-out.*"))
    calibrated = run_cli("calibrate", input_models["gather"], "--out", workspace / "never.yaml")
    last = calibrated.err.strip().splitlines()[-1]  # after the warning that random inputs are used
    assert calibrated.code == 2 and last.startswith("amp-rewrite: error: "), calibrated.err
    assert re.search(r"\(indices\[0,\d\] = \d is not in \[0, 2\)\); pass real ones", last), last
    inputs = workspace / "ids.npz"
    rng = np.random.default_rng(5)
    np.savez(inputs, x=rng.standard_normal((3, 5)).astype(np.float32), ids=rng.integers(0, 5, (3, 4)))
    run = run_cli("convert", input_models["gather"], dst, "--inputs", inputs)  # int64 ids: cast with a note
    assert_ok(run)
    assert "cast to int32" in run.out and "ok   serving_default/y" in run.out


def test_tensorflow_errors_are_shortened_to_the_line_naming_the_cause() -> None:
    """Validation and calibration quote TensorFlow's errors by this one helper: the cause, not
    "Graph execution error:", the node and stack lines, "{{function_node ...}}" or "[Op:...]"."""
    @tf.function
    def inner(i: tf.Tensor) -> tf.Tensor:
        return tf.gather(tf.zeros([3]), i)

    @tf.function
    def outer(i: tf.Tensor) -> tf.Tensor:
        return inner(i) * 2

    causes = []
    for run in (lambda: outer(tf.constant(7)), lambda: tf.raw_ops.MatMul(a=tf.zeros([2, 3]), b=tf.zeros([2, 3]))):
        with pytest.raises(tf.errors.OpError) as raised:
            run()
        causes.append(tensorflow_cause(raised.value))
    assert causes == ["indices = 7 is not in [0, 3)", "Matrix size-incompatible: In[0]: [2,3], In[1]: [2,3]"]


def test_string_input_with_random_validation_exits_2_with_a_savez_line_that_works(
    workspace: Path, input_models: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random strings cannot be made: the line says which numpy.savez call writes inputs the
    model takes; run as it is, its file validates."""
    dst = workspace / "text-out"
    line = error_line(run_cli("convert", input_models["text"], dst, "--validate", 1))
    assert "'text'" in line and "string" in line and "--inputs inputs.npz" in line, line
    assert not dst.exists()
    call = line.split("saved so: ", 1)[1]
    assert call == "numpy.savez('inputs.npz', text=numpy.full((2,), 'text'))", call
    monkeypatch.chdir(workspace)
    exec(call, {"numpy": np})  # noqa: S102 - the line the user is told to run
    run = run_cli("convert", input_models["text"], dst, "--inputs", "inputs.npz")
    assert_ok(run)
    assert "ok   serving_default/length" in run.out


STRING_INPUTS = {  # numpy str arrays (<U) and bytes arrays (S), as numpy.savez writes them without pickle
    "vocabulary": {"tokens": np.array([["the", "cat", "sat"], ["a", "dog", "ran"], ["on", "the", "mat"]])},
    "tf1-text": {"sentences": np.array([b"the cat sat on the mat", b"a dog", b"ran"])},
}


@pytest.mark.parametrize("model", sorted(STRING_INPUTS))
def test_string_inputs_validate_and_calibrate_end_to_end(workspace: Path, input_models: Paths, model: str) -> None:
    """A vocabulary (StaticHashTable) model and a TF1 text model take str or bytes arrays in
    --inputs and --calibrate: calibrated, validated and written, in one real process."""
    data = workspace / f"{model}-strings.npz"
    np.savez(data, **STRING_INPUTS[model])
    dst = workspace / f"{model}-strings-out"
    process = run_process("convert", input_models[model], dst, "--calibrate", data, "--inputs", data)
    assert process.returncode == 0, process.stderr
    assert re.search(r"calibration: validation run 1: worst serving_default/scores p99-rel \S+ \(within the goal",
                     process.stdout), process.stdout
    assert "ok   serving_default/scores" in process.stdout and f"Wrote {dst}" in process.stdout, process.stdout
    assert re.search(r"Model: converted [1-9]|Converted [1-9]", process.stdout), process.stdout


def test_object_arrays_are_refused_saying_how_to_save_strings(workspace: Path, input_models: Paths) -> None:
    """An object array needs pickle to be read: refused, with the astype that saves it without."""
    data = workspace / "objects.npz"
    tokens = np.array([["the", "cat"]], dtype=object)
    np.savez(data, tokens=tokens)
    dst = workspace / "objects-out"
    line = error_line(run_cli("convert", input_models["vocabulary"], dst, "--inputs", data))
    assert "array 'tokens' holds Python objects" in line and "tokens.astype(str)" in line, line
    np.savez(data, tokens=tokens.astype(str))
    assert_ok(run_cli("convert", input_models["vocabulary"], dst, "--inputs", data))


def test_the_advice_for_a_dtype_that_does_not_fit_works(workspace: Path, saved_models: Paths) -> None:
    """A bool array for a float input: the line names the astype to apply; applied, it validates."""
    data = workspace / "bools.npz"
    arrays = {"x": np.ones((2, 5), bool), "z": np.ones((2, 16), np.float32)}
    np.savez(data, **arrays)
    line = error_line(run_cli("convert", saved_models["module"], workspace / "bools-out", "--inputs", data))
    advice = re.search(r"\((x\.astype\([^)]*\))\)$", line)
    assert advice, line
    np.savez(data, **{**arrays, "x": eval(advice.group(1), {"x": arrays["x"]})})  # noqa: S307 - the advice
    assert_ok(run_cli("convert", saved_models["module"], workspace / "bools-out", "--inputs", data))


def test_an_inputs_array_that_is_no_input_names_the_inputs(workspace: Path, saved_models: Paths) -> None:
    data = workspace / "extra.npz"
    np.savez(data, x=np.ones((2, 5), np.float32), z=np.ones((2, 16), np.float32), labels=np.ones(2))
    dst = workspace / "extra-out"
    line = error_line(run_cli("convert", saved_models["module"], dst, "--inputs", data))
    assert "'labels' match no input of the model; its inputs are 'x', 'z'" in line, line
    assert not dst.exists()


def test_failed_validation_writes_nothing_unless_keep_failed_and_a_rerun_works(
    workspace: Path, graph_files: Paths
) -> None:
    """The result the tool calls bad is not left in the way: the same command can run again,
    and --keep-failed writes it (still exit 1, and the line says so)."""
    overlay = workspace / "allow_exp_rerun.yaml"
    overlay.write_text("allow: {add: [Exp, Sum]}\ndeny: {remove: [Exp, Sum]}\n", encoding="utf-8")
    dst = workspace / "rerun.pb"
    args = ("convert", graph_files["overflow"], dst, "--lists", overlay, "--fetch", OVERFLOW_FETCH, "--validate", 1)
    for _ in range(2):
        line = error_line(run_cli(*args), code=1)
        assert f"nothing was written to {dst}" in line, line
        assert not dst.exists()
    kept = run_cli(*args, "--keep-failed")
    assert f"{dst} was written anyway (--keep-failed)" in error_line(kept, code=1)
    assert dst.is_file()


# --------------------------------------------------------------------------------------
# 9. Writing: modes, the source, a destination that appears meanwhile, interrupts


def _tree_modes(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): stat.S_IMODE(p.stat().st_mode) for p in [path, *path.rglob("*")]}


def _make_read_only(path: Path) -> None:
    for p in sorted([path, *path.rglob("*")], reverse=True):  # files and leaves first
        p.chmod(0o555 if p.is_dir() else 0o444)


CAP_DAC_READ_SEARCH = 2


def _as_nobody() -> tuple[str, ...]:
    """``setpriv`` to the unprivileged user 'nobody', keeping CAP_DAC_READ_SEARCH where root
    may pass it on: nobody then reads and searches any folder (the checkout and its
    virtualenv, wherever the clone lives, e.g. under a 0700 home or ``mktemp -d``) but writes
    only where its own permissions let it, which is what the test is about."""
    base = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")
    status = Path("/proc/self/status").read_text(encoding="utf-8")
    bounding = int(re.search(r"^CapBnd:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    if bounding >> CAP_DAC_READ_SEARCH & 1:
        return (*base, "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search")
    return base


@pytest.fixture()
def nobody_folder() -> Path:
    """A folder under /tmp that the unprivileged user 'nobody' can read (pytest's own are 0700)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the command as the unprivileged user 'nobody'")
    finds = subprocess.run([*_as_nobody(), sys.executable, "-c", FINDS_THE_PACKAGES], capture_output=True,
                           text=True, env=cli_env(), timeout=60)
    if finds.returncode != 0:
        pytest.skip("'nobody' cannot read this checkout or its Python packages, and this system does not let root"
                    f" pass on CAP_DAC_READ_SEARCH: {finds.stderr.strip()[-300:]}")
    folder = Path(tempfile.mkdtemp(prefix="amp-rewrite-nobody-"))
    folder.chmod(0o755)
    yield folder
    for p in [folder, *folder.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.rmtree(folder)


FINDS_THE_PACKAGES = "import importlib.util as u; assert u.find_spec('amp_rewrite') and u.find_spec('tensorflow')"
AS_NOBODY = _as_nobody()


def test_read_only_source_converts_as_a_normal_user(nobody_folder: Path, saved_models: Paths) -> None:
    """A source with read-only files and folders, converted by 'nobody': exit 0, the output's
    modes are that user's defaults (umask 022), and the user can remove it again."""
    src, out = nobody_folder / "src", nobody_folder / "out"
    shutil.copytree(saved_models["module"], src)
    _make_read_only(src)
    pw = pwd.getpwnam("nobody")
    for folder in (out, nobody_folder / "home"):  # home: Keras writes ~/.keras on import
        folder.mkdir()
        os.chown(folder, pw.pw_uid, pw.pw_gid)
    dst = out / "dst"
    process = subprocess.run([*AS_NOBODY, sys.executable, "-m", "amp_rewrite", "convert", str(src), str(dst)],
                             check=False, capture_output=True, text=True, timeout=300,
                             env=cli_env(HOME=str(nobody_folder / "home")), preexec_fn=lambda: os.umask(0o022))
    assert process.returncode == 0, process.stderr
    modes = _tree_modes(dst)
    assert {m for p, m in modes.items() if (dst / p).is_dir()} == {0o755}, modes
    assert {m for p, m in modes.items() if (dst / p).is_file()} == {0o644}, modes
    assert (dst / "variables").is_dir() and (dst / "assets").is_dir()
    # The read-only checkpoint was read, and written again in the copy with w2 stored float16.
    dtypes = tf.train.load_checkpoint(str(dst / "variables" / "variables")).get_variable_to_dtype_map()
    assert dtypes["w2/.ATTRIBUTES/VARIABLE_VALUE"] == tf.float16
    removed = subprocess.run([*AS_NOBODY, "rm", "-rf", str(dst)], check=False, capture_output=True, text=True)
    assert removed.returncode == 0 and listing(out) == set(), removed.stderr


@pytest.mark.parametrize("how", ["dump-into-source", "convert-dump-into-source"])
def test_no_subcommand_writes_inside_the_source(workspace: Path, saved_models: Paths, how: str) -> None:
    src = workspace / f"own-{how}"
    shutil.copytree(saved_models["module"], src)
    before = hash_tree(src)
    if how == "dump-into-source":
        line = error_line(run_cli("dump", src, src))
        assert "dump directory" in line, line
        error_line(run_cli("dump", src, src / "report"))
    else:
        line = error_line(run_cli("convert", src, workspace / f"{how}-dst", "--dump", src / "report"))
        assert "dump directory" in line and not (workspace / f"{how}-dst").exists(), line
    assert hash_tree(src) == before


def test_a_destination_that_appears_meanwhile_is_not_replaced(
    workspace: Path, saved_models: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs to one destination, forced to overlap: the second finishes while the first
    is moving its result into place. The first must not replace it (no --force): exit 2,
    the destination holds the second run's model, nothing hidden is left."""
    folder = workspace / "race"
    folder.mkdir()
    dst = folder / "dst"
    real, other_runs = staging._move_into_place, []

    def overlapping(staged: Path, destination: Path) -> None:
        if not other_runs:
            other_runs.append(None)
            other_runs[0] = run_cli("convert", saved_models["keras"], dst)
        real(staged, destination)

    monkeypatch.setattr(staging, "_move_into_place", overlapping)
    line = error_line(run_cli("convert", saved_models["module"], dst))
    assert_ok(other_runs[0])
    assert "appeared while this run was writing" in line and "--force" in line, line
    assert listing(folder) == {"dst"}
    signatures = set(meta_graphs_of(dst)["serve"].signature_def)
    assert "serve" in signatures and "other" not in signatures, signatures  # the Keras model's


def _default_valued_attrs(meta: Any) -> int:
    from tensorflow.python.framework import meta_graph, op_def_registry

    nodes = [*meta.graph_def.node, *(n for f in meta.graph_def.library.function for n in f.node_def)]
    return sum(1 for node in nodes if op_def_registry.get(node.op) is not None
               for name, value in node.attr.items()
               if meta_graph._is_default_attr_value(op_def_registry.get(node.op), name, value))


@pytest.mark.parametrize("model", MODELS)
def test_stripped_default_attrs_stays_true(conversions: Conversions, model: str) -> None:
    """The source promises stripped default attrs; the rewrite spells them out, so the result
    strips them again (saved_model_cli and tf.saved_model.load read it: tests above)."""
    conversion = converted(conversions, model, "float16")
    source, result = meta_graphs_of(conversion.src)["serve"], meta_graphs_of(conversion.dst)["serve"]
    assert source.meta_info_def.stripped_default_attrs and result.meta_info_def.stripped_default_attrs
    assert _default_valued_attrs(result) == 0


# --------------------------------------------------------------------------------------
# 10. Fast help, refusals and warnings that need no conversion


HELP_PROBE = """
import sys
from amp_rewrite.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit_:
    print("exit", exit_.code)
print("tensorflow imported:", "tensorflow" in sys.modules)
"""


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["convert", "--help"]], ids=" ".join)
def test_help_and_version_do_not_import_tensorflow(args: list[str]) -> None:
    """Arguments are parsed before TensorFlow is imported, so these answer at once."""
    process = subprocess.run([sys.executable, "-c", HELP_PROBE, *args], check=False, capture_output=True,
                             text=True, env=cli_env(), timeout=60)
    lines = process.stdout.splitlines()
    assert lines[-2:] == ["exit 0", "tensorflow imported: False"], process.stdout + process.stderr
    if args == ["--version"]:
        assert lines[0] == f"amp-rewrite {amp_rewrite_version()}"
    else:
        assert "examples:" in process.stdout and "exit codes:" in process.stdout and "``" not in process.stdout


def amp_rewrite_version() -> str:
    from importlib import metadata

    return metadata.version("amp_rewrite")


def test_parser_targets_are_the_targets() -> None:
    """The parser spells the targets out (no TensorFlow import for --help); they must be core's,
    float8 (built on float16's colouring) included."""
    from amp_rewrite.core.target import NAME_TO_QUANTIZED_TARGET

    assert options.TARGET_NAMES == (*amp_rewrite.TARGETS, *NAME_TO_QUANTIZED_TARGET)


@pytest.mark.parametrize("args, mention", [
    (["--validate", "-3"], "argument --validate: '-3': use a whole number, 1 or more"),
    (["--validate", "0"], "argument --validate: '0': use a whole number, 1 or more"),
    (["--max-rounds", "11"], "argument --max-rounds: '11': use a whole number from 1 to 10"),
], ids=["validate-negative", "validate-0", "max-rounds-11"])
def test_counts_are_checked_before_anything_runs(workspace: Path, args: list[str], mention: str) -> None:
    """Counts are refused by the argument parser (exit 2), before TensorFlow is imported."""
    line = error_line(run_cli("convert", workspace / "not-read", workspace / "never", *args))
    assert line == f"amp-rewrite: error: {mention}; see amp-rewrite convert --help", line


def test_a_saved_model_pb_path_says_to_pass_its_directory(workspace: Path, saved_models: Paths) -> None:
    line = error_line(run_cli("convert", saved_models["module"] / "saved_model.pb", workspace / "from-pb"))
    assert line.endswith(f"the graph file of a SavedModel; pass the directory {saved_models['module']}"), line


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_keras_file_is_refused_with_how_to_export(workspace: Path, suffix: str) -> None:
    source = workspace / f"model{suffix}"
    source.write_bytes(b"not read")
    line = error_line(run_cli("convert", source, workspace / f"from{suffix}"))
    assert "model.export(dir)" in line and f"model{suffix}" in line, line


def test_tf_keras_savedmodel_warns_that_load_model_ignores_the_rewrite(workspace: Path, saved_models: Paths) -> None:
    """tf_keras' model.save(dir) writes keras_metadata.pb; tf_keras.models.load_model rebuilds
    float32 layers from it, so the command says so when it converts one."""
    src = workspace / "tf_keras_like"
    shutil.copytree(saved_models["module"], src)
    (src / "keras_metadata.pb").write_bytes(b"")
    run = run_cli("convert", src, workspace / "tf_keras_like_out")
    assert_ok(run)
    assert run.err.startswith("amp-rewrite: warning:") and "tf_keras.models.load_model" in run.err, run.err


def test_inspect_quiet_prints_only_the_headline(saved_models: Paths) -> None:
    run = run_cli("inspect", saved_models["module"], "--quiet")
    assert_ok(run)
    assert len(run.out.splitlines()) == 1 and run.out.startswith("Model: converted "), run.out


def test_steps_show_on_a_terminal_and_not_otherwise(workspace: Path, graph_files: Paths) -> None:
    """A terminal sees a line per step (loading, rewriting, writing, validating); a pipe sees none."""
    import pty

    controller, terminal = pty.openpty()
    args = [sys.executable, "-m", "amp_rewrite", "convert", str(graph_files[".pb"]), "--validate", "1"]
    with os.fdopen(controller, "rb", buffering=0) as reader:
        process = subprocess.Popen([*args, str(workspace / "tty.pb")], stdout=subprocess.DEVNULL,
                                   stderr=terminal, env=cli_env())
        os.close(terminal)
        chunks = []
        with contextlib.suppress(OSError):  # EIO once the process has closed the terminal
            while chunk := reader.read(4096):
                chunks.append(chunk)
        assert process.wait(timeout=300) == 0
    shown = b"".join(chunks).decode()
    for step in ("reading", "rewriting", "writing", "validating"):
        assert f"amp-rewrite: {step}" in shown, shown
    loading = re.search(r"^amp-rewrite: loading TensorFlow … (\d+\.\d) s\r?$", shown, re.M)
    assert loading and float(loading.group(1)) >= 0.5, shown  # the import happens in this step, not before
    piped = subprocess.run([*args, str(workspace / "piped.pb")], capture_output=True, text=True, env=cli_env(),
                           timeout=300)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr


# --------------------------------------------------------------------------------------
# 11. explain and hints about the model


def test_explain_unknown_node_says_how_to_list_node_names(saved_models: Paths) -> None:
    line = error_line(run_cli("explain", saved_models["module"], "no_such_node"))
    assert "'no_such_node'" in line and "amp-rewrite dump" in line, line


def test_explain_finds_any_node_and_takes_the_main_graph_label(saved_models: Paths) -> None:
    """A node without a float type attribute (the saver's string filename) is found and said
    to have nothing to decide; ``--function "(main graph)"``, as inspect names it, is accepted."""
    for extra in ([], ["--function", "(main graph)"]):
        run = run_cli("explain", saved_models["module"], "saver_filename", *extra)
        assert_ok(run)
        assert run.out.startswith("saver_filename (Placeholder): no float type attribute"), run.out


def test_no_tensor_core_hint_for_a_depthwise_channel_multiplier(workspace: Path) -> None:
    """A depthwise filter's last dim is the channel multiplier (1 here), which no user can
    change: the converted DepthwiseConv2dNative gets no hint, while odd channels of a Conv2D do."""
    @tf.function(input_signature=[tf.TensorSpec([1, 8, 8, 8], tf.float32, name="x")], autograph=False)
    def graph(x: tf.Tensor) -> tf.Tensor:
        depthwise = tf.nn.depthwise_conv2d(x, tf.constant(np.full((3, 3, 8, 1), 0.1, np.float32)),
                                           [1, 1, 1, 1], "SAME", name="depthwise")
        return tf.nn.conv2d(depthwise, tf.constant(np.full((1, 1, 8, 5), 0.1, np.float32)), 1, "SAME", name="conv")

    source = write_graph_def(graph.get_concrete_function().graph.as_graph_def(), workspace / "depthwise.pb")
    explained = run_cli("explain", source, "depthwise")
    assert_ok(explained)
    assert "Outputs (no --fetch; the nodes nothing reads keep their dtypes): Identity\n" in explained.out
    assert "depthwise (DepthwiseConv2dNative), attribute T: float32 -> float16" in explained.out
    run = run_cli("inspect", source)
    assert_ok(run)
    hints = run.out.split("Tensor Core hints", 1)[1].splitlines()[1:] if "Tensor Core hints" in run.out else []
    assert any(h.strip().startswith("conv ") for h in hints), run.out
    assert not any("Depthwise" in h for h in hints), run.out


# --------------------------------------------------------------------------------------
# 12. dump: the model apart from TensorFlow's plumbing, big graphs drawn by name scope


def test_dump_shows_plumbing_apart_and_one_cast_count(workspace: Path, saved_models: Paths) -> None:
    """report.html: decisions of the model's functions only, the plumbing in one collapsed
    table, its items not drawn; the casts card is the model's casts to the target."""
    directory = workspace / "dump-plumbing"
    assert_ok(run_cli("dump", saved_models["module"], directory))
    page = (directory / "report.html").read_text(encoding="utf-8")
    rows = re.findall(r'<tr data-function="([^"]*)"', page)
    assert rows and all(re.match(r"__inference_(serve|other|weights)_\d+$", f) for f in rows), sorted(set(rows))
    assert page.count('<details id="plumbing">') == 1
    plumbing = page.split('<details id="plumbing">', 1)[1].split("</details>", 1)[0]
    assert "__inference__traced_save_" in plumbing and "__inference_signature_wrapper_" in plumbing
    svgs = {p.name for p in (directory / "graphs").glob("*.svg")}
    if shutil.which("dot"):
        assert svgs and not any("traced" in name or "signature_wrapper" in name for name in svgs), svgs
    report = savedmodel.rewrite_model(savedmodel.read_model(saved_models["module"]), target="float16",
                                      lists=amp_rewrite.load_lists("float16")).report
    model_casts = sum(item.casts_to_target for item in report.items
                      if re.match(r"__inference_(serve|other|weights)_\d+$", item.function))
    assert f"<b>{model_casts}</b><span>casts to float16</span>" in page


def test_dump_draws_a_graph_over_the_limit_by_name_scope(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the node limit the drawing collapses nodes into their name scopes instead of
    being skipped; the full .dot stays."""
    if not shutil.which("dot"):
        pytest.skip("Graphviz's dot is not installed (apt-get install -y graphviz)")
    from amp_rewrite.cli import dump

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32, name="x")], autograph=False)
    def graph(x: tf.Tensor) -> tf.Tensor:
        for block in range(3):
            with tf.name_scope(f"block{block}"):
                x = tf.nn.relu(tf.matmul(x, tf.constant(np.full((16, 16), 0.1, np.float32))) + 1.0)
        return x

    source = write_graph_def(graph.get_concrete_function().graph.as_graph_def(), workspace / "scoped.pb")
    monkeypatch.setattr(dump, "SVG_MAX_NODES", 8)
    directory = workspace / "dump-scopes"
    assert_ok(run_cli("dump", source, directory))
    assert (directory / "graphs" / "main.dot").is_file() and (directory / "graphs" / "main.svg").is_file()
    scopes = (directory / "graphs" / "main.scopes.dot").read_text(encoding="utf-8")
    for block in range(3):
        assert f'"block{block}"' in scopes, scopes
    assert "name scopes" in (directory / "report.html").read_text(encoding="utf-8")
