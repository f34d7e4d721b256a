"""Weights stored in the target precision (``convert``'s default; ``--float32-weights`` keeps
them float32): a variable every reader reads through a cast to the target holds the target
dtype — in every graph and function that touches it, in the object graph and in the
checkpoint, rounded once as the cast rounds it — and the casts go; everything a SavedModel
user does still works, with the same numbers as the float32-weights conversion.

Most tests read the conversions one module-scoped fixture makes (``converted``).
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.core.protobuf import saved_model_pb2

from amp_rewrite.core.program import program_of
from amp_rewrite.core.weights import round_to

from cli_models import (
    ASSET_TEXT, GRAPH_FETCHES, TWO_TAG_SETS, WEIGHTS_LOW, graph_def_with_deny_path, hash_tree, save_two_tag_model,
    save_weights_module, write_graph_def,
)
from test_cli import Run, assert_ok, error_line, listing, run_cli

BF16, F32 = types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT
BIN = Path(sys.executable).parent
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


@dataclass(frozen=True)
class Models:
    root: Path
    src: dict[str, Path]
    out: dict[str, Path]
    runs: dict[str, Run]
    saved_model_cli: subprocess.Popen  # `saved_model_cli run` on the converted module, started with the fixture


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Models]:
    """The source models and their bfloat16 conversions, in-process: the weights module
    (default, with --validate and --dump; and --float32-weights), a TF1 Builder model with
    one MetaGraphDef and one with two, a frozen GraphDef (default and --float32-weights)."""
    root = tmp_path_factory.mktemp("weights")
    src = {"module": root / "module", "tf1": root / "tf1", "two_tags": root / "two_tags",
           "frozen": root / "frozen.pb"}
    save_weights_module(src["module"])
    save_two_tag_model(src["tf1"], ("serve",))
    save_two_tag_model(src["two_tags"])
    write_graph_def(graph_def_with_deny_path(), src["frozen"])
    fetches = [arg for fetch in GRAPH_FETCHES for arg in ("--fetch", fetch)]
    jobs = {
        "module": (src["module"], "--validate", "1", "--dump", root / "dump"),
        "module_f32w": (src["module"], "--float32-weights"),
        "tf1": (src["tf1"],),
        "two_tags": (src["two_tags"],),
        "frozen": (src["frozen"], *fetches),
        "frozen_f32w": (src["frozen"], *fetches, "--float32-weights"),
    }
    out, runs = {}, {}
    (root / "out").mkdir()
    for name, (source, *args) in jobs.items():
        out[name] = root / "out" / (name + (".pb" if source.suffix == ".pb" else ""))
        runs[name] = run_cli("convert", source, out[name], "--target", "bfloat16", *args)
    np.save(root / "ones.npy", np.ones((2, 8), np.float32))
    saved_model_cli = subprocess.Popen(
        [str(BIN / "saved_model_cli"), "run", "--dir", str(out["module"]), "--tag_set", "serve", "--signature_def",
         "other", "--inputs", f"x={root / 'ones.npy'}", "--outdir", str(root / "cli_run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # a new process: runs beside the other tests
    yield Models(root, src, out, runs, saved_model_cli)
    saved_model_cli.kill()
    saved_model_cli.communicate()


def _ok(models: Models, name: str) -> Path:
    assert_ok(models.runs[name])
    return models.out[name]


def _checkpoint(saved_model: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every key's dtype and value."""
    reader = tf.train.load_checkpoint(str(saved_model / "variables" / "variables"))
    dtypes = reader.get_variable_to_dtype_map()
    return dtypes, {key: reader.get_tensor(key) for key in dtypes}


def _meta(saved_model: Path, tags: tuple[str, ...] = ("serve",)) -> Any:
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((saved_model / "saved_model.pb").read_bytes())
    return next(meta for meta in proto.meta_graphs if set(meta.meta_info_def.tags) == set(tags))


def _key(name: str) -> str:
    return f"{name}/.ATTRIBUTES/VARIABLE_VALUE"


# --------------------------------------------------------------------------------------
# Rounding: once, as TensorFlow's Cast rounds


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_weights_are_rounded_as_tensorflows_cast_rounds_them(dtype: tf.DType) -> None:
    """Rule: a stored weight is bit for bit what the per-call cast gave (asked of TensorFlow
    live): ties to even, subnormals, overflow to inf, NaN, on random bit patterns too."""
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-9, 65504.0, 65520.0, 1e5, 3.4e38, -3.4e38, 1e-8,
                        6e-8, 1e-40, np.inf, -np.inf, np.nan], np.float32)
    values = np.concatenate([special, rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
                             .view(np.float32)]).reshape(-1, 4)
    ours = round_to(values, dtype.as_datatype_enum)
    theirs = tf.cast(tf.constant(values), dtype).numpy()
    assert ours.dtype == theirs.dtype
    nan = np.isnan(theirs.astype(np.float32))
    assert np.array_equal(np.isnan(ours.astype(np.float32)), nan)
    assert np.array_equal(ours[~nan].view(np.uint16), theirs[~nan].view(np.uint16))


def test_a_cast_that_is_an_output_keeps_its_name_and_an_updated_variable_stays_float32() -> None:
    """Rule (store_weights on a TF1 graph): a fetched cast of a low variable stays, a no-op
    bfloat16 -> bfloat16 cast, so the output keeps its name and dtype; a variable that
    AssignAddVariableOp updates stays float32 (an update in bfloat16 would round each step);
    the result imports, initializes (its initial value cast on the way in) and runs."""
    from amp_rewrite.core.weights import store_weights

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.compat.v1.get_variable("w", initializer=np.full((4, 4), 1 / 3, np.float32), use_resource=True)
        acc = tf.compat.v1.get_variable("acc", initializer=np.ones((4, 4), np.float32), use_resource=True)
        out = tf.cast(w, tf.bfloat16, name="out")
        tf.matmul(tf.cast(x, tf.bfloat16), out, name="y")
        tf.matmul(tf.cast(x, tf.bfloat16), tf.cast(acc, tf.bfloat16), name="z")
        acc.assign_add(tf.ones((4, 4)), name="update")
        tf.compat.v1.train.Saver()
    stored = store_weights(graph.as_graph_def(), "bfloat16", kept={("", "out"): "an output of the model"})
    weights = {weight.name: weight for weight in stored.weights}
    assert weights["w"].low and weights["w"].keys == ("w",)
    assert not weights["acc"].low and weights["acc"].reason.startswith("its handle goes to AssignAddVariableOp")
    nodes = {node.name: node for node in stored.graph_def.node}
    assert (nodes["out"].op, nodes["out"].attr["SrcT"].type, nodes["out"].attr["DstT"].type) == ("Cast", BF16, BF16)
    rebuilt = tf.Graph()
    with rebuilt.as_default():
        tf.graph_util.import_graph_def(stored.graph_def, name="")
    with tf.compat.v1.Session(graph=rebuilt) as session:
        session.run(["w/Assign", "acc/Assign"])
        got = session.run("out:0")
    assert got.dtype == tf.bfloat16.as_numpy_dtype
    assert np.array_equal(got.view(np.uint16), round_to(np.full((4, 4), 1 / 3, np.float32), BF16).view(np.uint16))


def _layer_graph() -> tf.Graph:
    """A TF1 graph whose variable ``w`` a tf.function reads through a cast (a control input
    on the cast too), beside a tf.function that reads no variable, and a Saver."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.compat.v1.get_variable("w", initializer=np.full((4, 4), 1 / 3, np.float32), use_resource=True)

        @tf.function(autograph=False)
        def layer(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            low = tf.cast(w, tf.bfloat16, name="low")
            with tf.control_dependencies([low]):
                return tf.matmul(tf.cast(x, tf.bfloat16), low, name="y"), low

        @tf.function(autograph=False)
        def twice(x: tf.Tensor) -> tf.Tensor:
            return x * 2.0

        y, low = layer(x)
        tf.identity(y, name="out")
        tf.identity(low, name="out_low")
        tf.identity(twice(x), name="twice")
        tf.compat.v1.train.Saver()
    return graph


def _run_layer(graph_def: graph_pb2.GraphDef, x: np.ndarray) -> list[np.ndarray]:
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        session.run("w/Assign")
        return session.run(["out:0", "out_low:0", "twice:0"], {"x:0": x})


def test_a_variable_a_function_reads_through_a_cast_is_stored_low_there_and_other_functions_stay_as_they_are() -> None:
    """Rule (store_weights on a graph that calls functions): the function a variable's handle
    is passed to reads it low, its cast gone and the cast's readers (a data and a control
    input) reading the read instead; the main graph's handle, saver and initializer follow; a
    function no variable reaches is byte for byte the input's, and so is the input; the
    result runs with the numbers the per-call cast gave."""
    from amp_rewrite.core.weights import store_weights

    graph_def = _layer_graph().as_graph_def()
    before = graph_def.SerializeToString(deterministic=True)
    stored = store_weights(graph_def, "bfloat16")
    assert graph_def.SerializeToString(deterministic=True) == before
    assert [(weight.name, weight.low, weight.keys) for weight in stored.weights] == [("w", True, ("w",))]
    functions = {function.signature.name.split("_")[3]: function for function in stored.graph_def.library.function}
    layer = {node.name: node for node in functions["layer"].node_def}
    assert "low" not in layer and not [node for node in layer.values() if node.op == "Cast" and node.name != "Cast"]
    assert layer["low/ReadVariableOp"].attr["dtype"].type == BF16
    assert list(layer["y"].input) == ["Cast:y:0", "low/ReadVariableOp:value:0"]
    assert list(layer["Cast"].input) == ["x", "^low/ReadVariableOp"]
    assert layer["Identity_1"].input[0] == "low/ReadVariableOp:value:0"
    source = {function.signature.name.split("_")[3]: function for function in graph_def.library.function}
    assert functions["twice"].SerializeToString(deterministic=True) == \
        source["twice"].SerializeToString(deterministic=True)
    main = {node.name: node for node in stored.graph_def.node}
    assert main["w"].attr["dtype"].type == BF16 and main["save/SaveV2"].attr["dtypes"].list.type[0] == BF16
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    for got, expected in zip(_run_layer(stored.graph_def, x), _run_layer(graph_def, x)):
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()


# --------------------------------------------------------------------------------------
# A TF2 SavedModel: the graph, the object graph and the checkpoint change together


def test_variables_every_reader_reads_low_are_stored_low_and_one_read_as_float32_is_not(converted: Models) -> None:
    """Rule: shared (two signatures), looped (a while body) and table (a ResourceGather) are
    bfloat16 in the checkpoint, their values rounded once; mixed, also read by Exp, stays
    float32 and the output says why; every other tensor, the object graph's included, is
    byte for byte the source's."""
    out = _ok(converted, "module")
    dtypes, values = _checkpoint(out)
    source_dtypes, source_values = _checkpoint(converted.src["module"])
    assert set(dtypes) == set(source_dtypes)
    for name in WEIGHTS_LOW:
        assert dtypes[_key(name)] == tf.bfloat16, name
        expected = round_to(source_values[_key(name)], BF16)
        assert np.array_equal(values[_key(name)].view(np.uint16), expected.view(np.uint16)), name
    unchanged = [key for key in dtypes if key not in {_key(name) for name in WEIGHTS_LOW}]
    assert _key("mixed") in unchanged and OBJECT_GRAPH_KEY in unchanged
    for key in unchanged:
        assert dtypes[key] == source_dtypes[key]
        assert values[key].tobytes() == source_values[key].tobytes() if key != OBJECT_GRAPH_KEY \
            else values[key] == source_values[key]
    run = converted.runs["module"].out
    assert "Weights: 3 of 4 float32 variable(s) stored as bfloat16 (960 B -> 544 B); 1 stays float32:" in run
    assert "  mixed: read as float32 by Exp 'Exp' in __inference_other_" in run
    def size(saved_model: Path) -> int:
        return sum(file.stat().st_size for file in (saved_model / "variables").iterdir())

    assert size(out) < size(converted.src["module"])


def test_the_object_graph_says_the_dtype_the_checkpoint_holds(converted: Models) -> None:
    """Rule: each SavedVariable's dtype is its checkpoint tensor's (the loader makes the
    variable from it, then restores the tensor into it)."""
    out = _ok(converted, "module")
    dtypes, _ = _checkpoint(out)
    meta = _meta(out)
    found = {node.variable.name: node.variable.dtype for node in meta.object_graph_def.nodes
             if node.WhichOneof("kind") == "variable"}
    assert found == {name: (BF16 if name in WEIGHTS_LOW else F32) for name in (*WEIGHTS_LOW, "mixed")}
    assert all(dtypes[_key(name)].as_datatype_enum == dtype for name, dtype in found.items())


def _handles(meta: Any) -> dict[tuple[str, str], int]:
    """(item, node) -> dtype of every op that carries a variable's dtype."""
    program = program_of(meta.graph_def)
    found = {}
    for item in program.names:
        for node in program.item(item).node:
            if node.op in ("VarHandleOp", "ReadVariableOp", "ResourceGather", "AssignVariableOp"):
                found[(item, node.name)] = node.attr["dtype"].type
    return found


def test_every_op_on_a_low_variable_has_its_dtype_and_no_cast_reads_it(converted: Models) -> None:
    """Rule: VarHandleOp, ReadVariableOp, ResourceGather and AssignVariableOp of a low
    variable are bfloat16 in the main graph and every function (the signatures', the while
    body's, the save and restore functions'); SaveV2/RestoreV2 say bfloat16 for its key; no
    cast reads its values; the float32 variable keeps its reads and their casts."""
    meta = _meta(_ok(converted, "module"))
    source = _meta(converted.src["module"])
    program = program_of(meta.graph_def)
    reads_of = {}  # (item, read) -> variable name, through the handles of the source's main graph
    before, after = _handles(source), _handles(meta)
    hoisted = {place for place in after if "/hoisted/" in place[1]}  # a loop's read moved before it (core/hoist.py)
    assert set(after) - hoisted == set(before)
    assert hoisted and all(after[place] == BF16 for place in hoisted)
    changed = {place for place in after if place not in hoisted and after[place] != before[place]}
    assert changed and all(after[place] == BF16 and before[place] == F32 for place in changed)
    main_low = {node for item, node in changed if item == "" and node in {*WEIGHTS_LOW}}
    assert main_low == set(WEIGHTS_LOW)
    assert ("", "mixed") not in changed
    kinds = {item: {node.name: node for node in program.item(item).node} for item in program.names}
    bodies = {item for item, _ in changed}
    assert any(name.startswith("while_body") for name in bodies) and any("traced_save" in n for n in bodies)
    assert any("traced_restore" in name for name in bodies)
    for item, nodes in kinds.items():
        for node in nodes.values():
            if node.op == "Cast" and node.input:
                source_node = nodes.get(node.input[0].split(":")[0])
                if source_node is not None and source_node.op in ("ReadVariableOp", "ResourceGather"):
                    reads_of[(item, node.name)] = source_node.attr["dtype"].type
            if node.op in ("SaveV2", "RestoreV2"):
                names = tf.make_ndarray(nodes[node.input[1].split(":")[0]].attr["value"].tensor)
                dtypes = dict(zip((n.decode() for n in names), node.attr["dtypes"].list.type))
                assert all(dtypes[_key(name)] == BF16 for name in WEIGHTS_LOW)
                assert dtypes[_key("mixed")] == F32
    assert reads_of and set(reads_of.values()) == {F32}  # only the float32 variable's reads are cast


def test_the_result_serves_every_signature_with_the_numbers_of_float32_weights(converted: Models) -> None:
    """Rule: tf.saved_model.load gives every signature with the same names, dtypes and
    shapes, variables of the stored dtypes, the asset, and outputs equal to the
    --float32-weights conversion's: the cast each call did is done once, on disk."""
    low, float32 = tf.saved_model.load(str(_ok(converted, "module"))), tf.saved_model.load(
        str(_ok(converted, "module_f32w")))
    source = tf.saved_model.load(str(converted.src["module"]))
    assert sorted(low.signatures) == sorted(source.signatures) == ["other", "serving_default"]
    feeds = {"serving_default": {"x": tf.constant(np.random.default_rng(1).standard_normal((3, 8)), tf.float32),
                                 "ids": tf.constant([0, 9, 4])},
             "other": {"x": tf.constant(np.random.default_rng(2).standard_normal((3, 8)), tf.float32)}}
    for key, feed in feeds.items():
        signature = low.signatures[key]
        assert signature.structured_input_signature == source.signatures[key].structured_input_signature
        assert signature.structured_outputs == source.signatures[key].structured_outputs
        got, want = signature(**feed), float32.signatures[key](**feed)
        for name in want:
            assert got[name].dtype == tf.float32
            np.testing.assert_array_equal(got[name].numpy(), want[name].numpy(), err_msg=f"{key}/{name}")
    assert [low.shared.dtype, low.looped.dtype, low.table.dtype, low.mixed.dtype] == [tf.bfloat16] * 3 + [tf.float32]
    assert Path(low.vocab.asset_path.numpy().decode()).read_text(encoding="utf-8") == ASSET_TEXT


def _tf1_outputs(saved_model: Path, signature_key: str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A TF1 Session loader with the serve tag, as TF Serving and saved_model_cli load."""
    graph = tf.Graph()
    with tf.compat.v1.Session(graph=graph) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(saved_model))
        signature = meta.signature_def[signature_key]
        return session.run({k: v.name for k, v in signature.outputs.items()},
                           {signature.inputs[k].name: v for k, v in feed.items()})


def test_a_tf1_session_loader_restores_and_runs_the_result(converted: Models) -> None:
    """Rule: tf.compat.v1.saved_model.loader.load (serve tag) restores the low variables
    through the retyped restore function and runs every signature as TF2 does."""
    out = _ok(converted, "module")
    loaded = tf.saved_model.load(str(out))
    feed = {"x": np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32), "ids": np.array([1, 2], np.int32)}
    for key, inputs in (("serving_default", feed), ("other", {"x": feed["x"]})):
        got = _tf1_outputs(out, key, inputs)
        want = loaded.signatures[key](**{k: tf.constant(v) for k, v in inputs.items()})
        for name in want:
            np.testing.assert_allclose(got[name], want[name].numpy(), rtol=1e-6, atol=1e-6, err_msg=f"{key}/{name}")


def test_float32_weights_copies_the_checkpoint_byte_for_byte(converted: Models) -> None:
    """Rule: --float32-weights keeps every weight float32, read through its cast on each call."""
    out = _ok(converted, "module_f32w")
    assert hash_tree(out / "variables") == hash_tree(converted.src["module"] / "variables")
    assert "Weights: kept float32 (--float32-weights)" in converted.runs["module_f32w"].out
    assert all(dtype == F32 for dtype in _handles(_meta(out)).values() if dtype in (F32, BF16))


def test_validate_and_the_report_see_the_stored_weights(converted: Models) -> None:
    """Rule: --validate compares the written result (low weights) with the source, and
    report.html has the weights line convert printed."""
    run = converted.runs["module"]
    assert "ok   serving_default/y" in run.out and "ok   other/out" in run.out
    page = (converted.root / "dump" / "report.html").read_text(encoding="utf-8")
    assert "Weights: 3 of 4 float32 variable(s) stored as bfloat16 (960 B -&gt; 544 B)" in page


def test_inspect_counts_the_weights_and_their_bytes(converted: Models) -> None:
    """Rule: inspect says what convert would store low, the bytes, and why the others stay."""
    inspected = run_cli("inspect", converted.src["module"], "--target", "bfloat16")
    assert_ok(inspected)
    assert "Weights: 3 of 4 float32 variable(s) stored as bfloat16 (960 B -> 544 B); 1 stays float32:" in inspected.out
    assert "  mixed: read as float32 by Exp" in inspected.out
    kept = run_cli("inspect", converted.src["module"], "--target", "bfloat16", "--float32-weights")
    assert "Weights: kept float32 (--float32-weights)" in kept.out


def test_a_tf_keras_saved_models_weights_stay_float32_for_load_model(tmp_path: Path) -> None:
    """Rule: tf_keras' model.save(dir) also saves each layer's call functions, which only
    the object graph calls; they are rewritten (``tf.saved_model.load(...)(x)`` runs them in
    bfloat16), but tf_keras.models.load_model restores the checkpoint into the float32
    layers keras_metadata.pb describes, so every weight stays float32, saying why, and
    load_model still loads the result (a bfloat16 key would fail its restore)."""
    import tf_keras

    model = tf_keras.Sequential([tf_keras.Input((8,)), tf_keras.layers.Dense(4, name="dense")])
    model.save(str(tmp_path / "tf_keras"))
    run = run_cli("convert", tmp_path / "tf_keras", tmp_path / "out", "--target", "bfloat16")
    assert_ok(run)
    assert "Weights: 0 of 2 float32 variable(s) stored as bfloat16 (144 B -> 144 B); 2 stay float32:" in run.out
    assert "  dense/kernel: its checkpoint key 'layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE' is restored" \
        " into float32 layers by tf_keras.models.load_model" in run.out, run.out
    x = np.ones((2, 8), np.float32)
    expected = model(x).numpy()
    np.testing.assert_array_equal(tf_keras.models.load_model(str(tmp_path / "out"))(x).numpy(), expected)
    matmuls = {f.signature.name: node.attr["T"].type for f in _meta(tmp_path / "out").graph_def.library.function
               for node in f.node_def if node.op == "MatMul"}
    assert len(matmuls) > 2 and set(matmuls.values()) == {BF16}, matmuls  # the layer's functions too
    np.testing.assert_allclose(tf.saved_model.load(str(tmp_path / "out"))(x).numpy(), expected, rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------------------
# TF1 SavedModels and frozen GraphDefs


def test_a_tf1_saved_model_stores_its_variable_low_and_its_saver_follows(converted: Models) -> None:
    """Rule: in a TF1 Builder SavedModel the main graph's saver (save/SaveV2, save/RestoreV2)
    and the variable's initializer (its float32 value cast on the way in) follow; a Session
    restores the rounded value; the outputs are within tolerance."""
    out = _ok(converted, "tf1")
    assert "Weights: 1 of 1 float32 variable(s) stored as bfloat16 (1.0 kB -> 512 B)" in converted.runs["tf1"].out
    dtypes, values = _checkpoint(out)
    _, source = _checkpoint(converted.src["tf1"])
    assert dtypes == {"w": tf.bfloat16}
    assert np.array_equal(values["w"].view(np.uint16), round_to(source["w"], BF16).view(np.uint16))
    nodes = {node.name: node for node in _meta(out).graph_def.node}
    assert nodes["save/RestoreV2"].attr["dtypes"].list.type == [BF16] == nodes["save/SaveV2"].attr["dtypes"].list.type
    cast = nodes[nodes["w/Assign"].input[1]]
    assert cast.op == "Cast" and cast.attr["DstT"].type == BF16 and cast.input == ["w/Initializer/initial_value"]
    x = np.random.default_rng(4).uniform(-1, 1, (3, 16)).astype(np.float32)
    got, want = _tf1_outputs(out, "serving_default", {"x": x}), _tf1_outputs(converted.src["tf1"], "serving_default",
                                                                             {"x": x})
    np.testing.assert_allclose(got["y"], want["y"], atol=5e-2 * np.abs(want["y"]).max())


def test_a_variable_another_meta_graph_restores_stays_float32(converted: Models) -> None:
    """Rule: variables/ is shared by every MetaGraphDef; one the run does not convert
    restores float32, so the variable stays float32 and the output says so."""
    out = _ok(converted, "two_tags")
    assert "w: its checkpoint key 'w' is also restored by the MetaGraphDef tagged 'train'" in converted.runs[
        "two_tags"].out
    assert hash_tree(out / "variables") == hash_tree(converted.src["two_tags"] / "variables")
    graph = tf.Graph()
    with tf.compat.v1.Session(graph=graph) as session:
        tf.compat.v1.saved_model.loader.load(session, [TWO_TAG_SETS[0]], str(out))  # restores as it did


def _graph_outputs(path: Path, x: np.ndarray) -> list[np.ndarray]:
    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(path.read_bytes())
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        return session.run([f"{fetch}:0" for fetch in GRAPH_FETCHES], {"x:0": x})


def test_a_frozen_graph_stores_const_weights_read_through_casts_low(converted: Models) -> None:
    """Rule: a float32 Const read only through casts to the target becomes a target Const
    of the rounded values, the casts gone; the outputs equal --float32-weights'."""
    out = _ok(converted, "frozen")
    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(out.read_bytes())
    consts = [node for node in graph_def.node if node.op == "Const" and node.attr["dtype"].type == BF16]
    assert len(consts) == 2 and all(tf.make_ndarray(c.attr["value"].tensor).size in (256, 192) for c in consts)
    nodes = {node.name: node for node in graph_def.node}
    for node in graph_def.node:
        if node.op == "Cast":
            assert nodes[node.input[0].split(":")[0]].op != "Const", node.name
    assert "Weights: 2 of 2 float32 constant(s) stored as bfloat16 (1.8 kB -> 896 B)" in converted.runs["frozen"].out
    x = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)
    for got, want in zip(_graph_outputs(out, x), _graph_outputs(_ok(converted, "frozen_f32w"), x)):
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written


def test_a_checkpoint_that_cannot_be_read_is_one_line_and_nothing_is_written(converted: Models) -> None:
    """Rule: a truncated variables/ data file is exit 2 naming the checkpoint, the source untouched."""
    broken = converted.root / "truncated"
    subprocess.run(["cp", "-r", str(converted.src["module"]), str(broken)], check=True)
    data = next((broken / "variables").glob("variables.data-*"))
    data.write_bytes(data.read_bytes()[:40])
    before = hash_tree(broken)
    destination = converted.root / "bad" / "dst"
    destination.parent.mkdir()
    line = error_line(run_cli("convert", broken, destination, "--target", "bfloat16"))
    assert line == (f"amp-rewrite: error: {data}: 40 bytes, but the index places keys up to byte"
                    f" {len((converted.src['module'] / 'variables' / data.name).read_bytes())}; the shard is truncated:"
                    " copy variables/ from the original export")
    assert listing(destination.parent) == set() and hash_tree(broken) == before


def test_a_variable_whose_ops_disagree_on_its_dtype_is_one_line_and_nothing_is_written(converted: Models) -> None:
    """Rule: a variable read as float16 in one function (then cast to float32) and held as
    float32 by its handle (a hand-edited or broken export; TensorFlow fails on it when it
    runs it) is exit 2 naming both ops, nothing written, the source untouched."""
    broken = converted.root / "disagree"
    subprocess.run(["cp", "-r", str(converted.src["module"]), str(broken)], check=True)
    proto = saved_model_pb2.SavedModel.FromString((broken / "saved_model.pb").read_bytes())
    other = next(f for f in proto.meta_graphs[0].graph_def.library.function
                 if f.signature.name.startswith("__inference_other_"))
    nodes = {node.name: node for node in other.node_def}
    matmul = next(node for node in other.node_def if node.op == "MatMul")
    read = nodes[matmul.input[1].split(":")[0]]
    assert read.op == "ReadVariableOp" and read.attr["dtype"].type == F32
    read.attr["dtype"].type = types_pb2.DT_HALF  # and a cast back, so that only the variable's ops disagree
    cast = other.node_def.add(name=f"{read.name}/back", op="Cast", input=[matmul.input[1]])
    cast.attr["SrcT"].type, cast.attr["DstT"].type = types_pb2.DT_HALF, F32
    matmul.input[1] = f"{cast.name}:y:0"
    (broken / "saved_model.pb").write_bytes(proto.SerializeToString())
    with pytest.raises(tf.errors.InvalidArgumentError):  # TensorFlow's own loader: the call fails
        tf.saved_model.load(str(broken)).signatures["other"](x=tf.ones((1, 8)))
    before = hash_tree(broken)
    destination = converted.root / "disagree_out" / "dst"
    destination.parent.mkdir()
    line = error_line(run_cli("convert", broken, destination, "--target", "bfloat16"))
    assert line.startswith(f"amp-rewrite: error: {broken}: the ops on one variable disagree on its dtype:"
                           " VarHandleOp '")
    assert f"ReadVariableOp '{read.name}' in {other.signature.name} says float16;" in line
    assert line.endswith("TensorFlow fails on it at run time: export the model again")
    assert listing(destination.parent) == set() and hash_tree(broken) == before


def test_a_checkpoint_whose_dtype_disagrees_with_the_graph_is_one_line_and_nothing_is_written(
        converted: Models) -> None:
    """Rule: variables/ holding a variable float16 that saved_model.pb holds float32 (files of
    two exports) is exit 2 naming the key, not a second rounding; nothing written."""
    mixed_up = converted.root / "mixed_up"
    subprocess.run(["cp", "-r", str(converted.src["module"]), str(mixed_up)], check=True)
    dtypes, values = _checkpoint(mixed_up)
    values[_key("shared")] = values[_key("shared")].astype(np.float16)
    for old in (mixed_up / "variables").iterdir():
        old.unlink()
    keys = sorted(dtypes)
    tf.raw_ops.SaveV2(prefix=str(mixed_up / "variables" / "variables"), tensor_names=keys,
                      shape_and_slices=[""] * len(keys), tensors=[values[key] for key in keys])
    before = hash_tree(mixed_up)
    destination = converted.root / "mixed_up_out" / "dst"
    destination.parent.mkdir()
    line = error_line(run_cli("convert", mixed_up, destination, "--target", "bfloat16"))
    assert line == (f"amp-rewrite: error: {mixed_up}/variables/variables: key '{_key('shared')}' holds float16 but"
                    " the graph reads variable 'shared' as float32; variables/ and saved_model.pb disagree: copy both"
                    " from one export")
    assert listing(destination.parent) == set() and hash_tree(mixed_up) == before


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_nothing_is_written(
        converted: Models, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: the checkpoint writer failing (a full disk) is exit 2, nothing at DST."""
    def full(**_: Any) -> None:
        raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")

    monkeypatch.setattr(tf.raw_ops, "SaveV2", full)
    destination = converted.root / "full" / "dst"
    destination.parent.mkdir()
    line = error_line(run_cli("convert", converted.src["module"], destination, "--target", "bfloat16"))
    assert line.endswith("variables: cannot write the checkpoint (No space left on device); nothing was written;"
                         " check the free space and permissions there")
    assert listing(destination.parent) == set()


def test_the_rewritten_checkpoint_is_the_same_bytes_each_run(converted: Models) -> None:
    """Rule: deterministic output: a second conversion writes the same variables/ and saved_model.pb."""
    again = converted.root / "again"
    assert_ok(run_cli("convert", converted.src["module"], again, "--target", "bfloat16"))
    assert hash_tree(again / "variables") == hash_tree(converted.out["module"] / "variables")
    first, second = ((p / "saved_model.pb").read_bytes() for p in (converted.out["module"], again))
    assert hashlib.sha256(first).digest() == hashlib.sha256(second).digest()


def test_saved_model_cli_runs_the_result(converted: Models) -> None:
    """Rule: TensorFlow's own tool runs a signature of the result (a TF1 Session inside);
    ``show --all``, which loads it with tf.saved_model.load, is test_cli's."""
    out = _ok(converted, "module")
    _, err = converted.saved_model_cli.communicate(timeout=300)
    assert converted.saved_model_cli.returncode == 0, err[-2000:]
    want = tf.saved_model.load(str(out)).signatures["other"](x=tf.ones((2, 8)))["out"].numpy()
    np.testing.assert_allclose(np.load(converted.root / "cli_run" / "out.npy"), want, rtol=1e-6)


# --------------------------------------------------------------------------------------
# Streaming: the checkpoint is written a chunk at a time, in the source's shards

CHUNK = 1024  # bytes of float32 values per chunk in these tests (the default is 16 MB)


class _Streamed(tf.Module):
    """A conv kernel (4.6 kB: sliced on its second axis), a dense kernel of 40 kB (sliced on
    its first) and two small ones, every one read through a cast by a converted op."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(3)
        self.conv = tf.Variable(rng.standard_normal((3, 3, 8, 16)).astype(np.float32), name="conv")
        self.big = tf.Variable(rng.standard_normal((16, 625)).astype(np.float32), name="big")
        self.w1 = tf.Variable(rng.standard_normal((625, 8)).astype(np.float32), name="w1")
        self.w2 = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32), name="w2")

    @tf.function(input_signature=[tf.TensorSpec([None, 6, 6, 8], tf.float32)])
    def serve(self, x: tf.Tensor) -> tf.Tensor:
        h = tf.reduce_mean(tf.nn.conv2d(x, self.conv, 1, "VALID"), axis=[1, 2])
        return tf.matmul(tf.nn.relu(tf.matmul(tf.matmul(h, self.big), self.w1)), self.w2)


def _shards(saved_model: Path) -> dict[str, tuple[frozenset[int], bool]]:
    """Each key of the checkpoint: (the shards holding its bytes, stored in slices)."""
    from amp_rewrite.calibration import bundle

    index = bundle.read_index(saved_model / "variables" / "variables")
    return {key: (frozenset(part.shard_id for _, part, _ in bundle.parts(index, key)), bool(entry.slices))
            for key, entry in index.entries.items() if not key.startswith("\0")}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("streamed")
    policy = tf.train.experimental.MaxShardSizePolicy(max_shard_size=12_000)
    tf.saved_model.save(_Streamed(), str(root / "src"), options=tf.saved_model.SaveOptions(
        experimental_sharding_callback=policy))
    return root / "src"


def test_the_checkpoint_is_written_a_chunk_at_a_time_in_the_sources_shards(
        streamed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: no SaveV2 call holds more than a chunk of values; a key larger than a chunk is
    written in slices; every key stays in its source shard; the values are the rounded
    source values, and the model serves the numbers of the float32-weights conversion."""
    from amp_rewrite.cli import weights

    calls: list[int] = []
    save = tf.raw_ops.SaveV2

    def counted(**kwargs: Any) -> Any:
        calls.append(sum(np.asarray(value).nbytes * 2 for value in kwargs["tensors"]))  # float32 bytes
        return save(**kwargs)

    monkeypatch.setattr(weights, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(tf.raw_ops, "SaveV2", counted)
    assert_ok(run_cli("convert", streamed, tmp_path / "low", "--target", "bfloat16"))
    monkeypatch.setattr(tf.raw_ops, "SaveV2", save)
    assert_ok(run_cli("convert", streamed, tmp_path / "f32w", "--target", "bfloat16", "--float32-weights"))
    source, result = _shards(streamed), _shards(tmp_path / "low")
    assert len(set().union(*(shards for shards, _ in source.values()))) >= 3, source
    assert {key: shard for key, (shard, _) in result.items()} == {key: shard for key, (shard, _) in source.items()}
    assert len(calls) >= 40 and max(calls) <= CHUNK, calls  # 4 low variables of 51 kB, 1 kB a call
    sliced = {key for key, (_, in_slices) in result.items() if in_slices}
    assert sliced == {_key("conv"), _key("big"), _key("w1")}
    old, new = _checkpoint(streamed)[1], _checkpoint(tmp_path / "low")[1]
    for name in ("conv", "big", "w1", "w2"):
        assert new[_key(name)].dtype == tf.bfloat16.as_numpy_dtype
        np.testing.assert_array_equal(new[_key(name)], round_to(old[_key(name)], BF16))
    x = tf.constant(np.random.default_rng(0).standard_normal((2, 6, 6, 8)).astype(np.float32))
    loaded = [tf.saved_model.load(str(tmp_path / name)) for name in ("low", "f32w")]
    np.testing.assert_array_equal(*(model.serve(x).numpy() for model in loaded))


class _ManySmall(tf.Module):
    """Forty small kernels, each read through a cast by a converted MatMul: forty keys of one chunk."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(5)
        self.kernels = [tf.Variable(rng.standard_normal((4, 4)).astype(np.float32), name=f"k{at}")
                        for at in range(40)]

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def serve(self, x: tf.Tensor) -> tf.Tensor:
        for kernel in self.kernels:
            x = tf.matmul(x, kernel)
        return x


def test_the_checkpoint_writer_sizes_each_key_once_however_many_a_chunk_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: writing the low checkpoint is linear in its keys: a chunk's size is kept as it
    fills, not summed again for each key added (a 1,000-block MLP's 8,000 keys, one chunk of
    about 2,700 each, spent about 4 s there)."""
    from amp_rewrite.cli import weights

    tf.saved_model.save(_ManySmall(), str(tmp_path / "src"))
    asked: list[str] = []
    elements = weights._Piece.elements

    def counted(piece: Any) -> int:
        asked.append(piece.key)
        return elements.fget(piece)

    monkeypatch.setattr(weights._Piece, "elements", property(counted))
    assert_ok(run_cli("convert", tmp_path / "src", tmp_path / "low", "--target", "bfloat16"))
    low = {key for key, value in _checkpoint(tmp_path / "low")[1].items()
           if getattr(value, "dtype", None) == tf.bfloat16.as_numpy_dtype}
    assert len(low) == 40, sorted(_checkpoint(tmp_path / "low")[1])
    assert set(asked) == low and len(asked) <= 2 * len(low), len(asked)


def test_a_missing_shard_is_one_line_and_nothing_is_written(streamed: Path, tmp_path: Path) -> None:
    """Rule: a shard the index names but variables/ lacks: exit 2 naming it, before anything is written."""
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(streamed), str(broken)], check=True)
    shard = sorted((broken / "variables").glob("variables.data-*"))[1]
    shard.unlink()
    before = hash_tree(broken)
    (tmp_path / "out").mkdir()
    for flags in ((), ("--float32-weights",)):
        line = error_line(run_cli("convert", broken, tmp_path / "out" / "dst", "--target", "bfloat16", *flags))
        count = len(list((streamed / "variables").glob("variables.data-*")))
        assert line == (f"amp-rewrite: error: {shard}: missing (the index names {count} shard(s)); copy variables/"
                        " from the original export")
        assert listing(tmp_path / "out") == set() and hash_tree(broken) == before


def test_a_destination_without_room_is_one_line_and_nothing_is_written(
        streamed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: the free space the result needs is checked first: too little is exit 2, nothing written."""
    import shutil

    from amp_rewrite.calibration import staging

    real = shutil.disk_usage

    def small(path: Any) -> Any:
        return real(path)._replace(free=30_000)

    monkeypatch.setattr(staging.shutil, "disk_usage", small)
    (tmp_path / "out").mkdir()
    line = error_line(run_cli("convert", streamed, tmp_path / "out" / "dst", "--target", "bfloat16"))
    assert line.startswith(f"amp-rewrite: error: {tmp_path / 'out'}: the result needs ")
    assert line.endswith("MB and 0.03 MB is free there; nothing was written; free some space or choose another"
                         " destination")
    assert listing(tmp_path / "out") == set()


def test_validation_holds_one_model_at_a_time(streamed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: --validate lets the source go before it loads the result: the two are never in memory together."""
    import gc
    import weakref

    loads: list[weakref.ref] = []
    alive_at_second: list[bool] = []
    load = tf.saved_model.load

    def tracked(path: str, tags: Any = None) -> Any:
        if loads:
            gc.collect()
            alive_at_second.append(loads[0]() is not None)
        model = load(path, tags=tags)
        loads.append(weakref.ref(model))
        return model

    monkeypatch.setattr(tf.saved_model, "load", tracked)
    assert_ok(run_cli("convert", streamed, tmp_path / "dst", "--target", "bfloat16", "--validate", "1"))
    assert alive_at_second == [False]


def test_a_validation_that_cannot_fit_in_memory_is_one_line_before_writing(
        streamed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: a model larger than the memory left is refused before anything is written, saying how to go on."""
    from amp_rewrite.calibration import validate

    monkeypatch.setattr(validate, "available_memory", lambda: 10_000)
    (tmp_path / "out").mkdir()
    line = error_line(run_cli("convert", streamed, tmp_path / "out" / "dst", "--target", "bfloat16", "--validate", 1))
    assert line == (f"amp-rewrite: error: {streamed}: --validate loads the model (0.0 GB) and 0.0 GB of memory is"
                    " available; it cannot fit: convert without --validate and --inputs, then validate the result"
                    " where it fits")
    assert listing(tmp_path / "out") == set()


def test_a_tuning_that_cannot_fit_both_models_in_memory_is_one_line_before_writing(
        streamed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: --tune speed runs the source and the result side by side (the whole-model check, a
    loop's whole run): where twice the model does not fit in the memory left, it is refused before
    anything is timed or written, saying how to go on."""
    from amp_rewrite.calibration import validate

    monkeypatch.setattr(validate, "available_memory", lambda: 10_000)
    (tmp_path / "out").mkdir()
    line = error_line(run_cli("convert", streamed, tmp_path / "out" / "dst", "--target", "bfloat16", "--tune", "speed",
                              "--tune-cache", tmp_path / "timings.json"))
    assert line.startswith(f"amp-rewrite: error: {streamed}: --tune speed runs the source and the result side by side (")
    assert line.endswith("GB of memory is available; it cannot fit: convert without --tune here, or tune where both fit")
    assert listing(tmp_path / "out") == set() and not (tmp_path / "timings.json").exists()


# --------------------------------------------------------------------------------------
# Fine-tuning: weights stored low are not float32 master weights, and say so


def test_a_fine_tuner_sees_the_low_weights_as_not_trainable_and_is_told(converted: Models, tmp_path: Path) -> None:
    """Rule: in a Keras export's result the bfloat16 variables are non-trainable (an update of
    3e-4 rounds away on a weight of 1): the variables, the export's lists and TFSMLayer's
    trainable weights say so; a TF1 result's trainable_variables collection likewise; convert
    says so and names --float32-weights, whose result keeps every variable trainable."""
    import keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.LayerNormalization()])
    model.export(str(tmp_path / "keras"), verbose=False)
    for name, flags in (("low", ()), ("f32w", ("--float32-weights",))):
        assert_ok(run_cli("convert", tmp_path / "keras", tmp_path / name, "--target", "bfloat16", *flags))
    low, kept = (tf.saved_model.load(str(tmp_path / name)) for name in ("low", "f32w"))
    assert len(low.variables) == len(kept.trainable_variables) == 4
    assert any(v.dtype == tf.bfloat16 for v in low.variables)
    assert all(v.trainable == (v.dtype == tf.float32) for v in low.variables)
    assert all(v.dtype == tf.float32 for v in low.trainable_variables)
    assert {v.name for v in low.non_trainable_variables} >= {v.name for v in low.variables if v.dtype == tf.bfloat16}
    layers = [keras.layers.TFSMLayer(str(tmp_path / name), call_endpoint="serve", trainable=True)
              for name in ("low", "f32w")]
    float32 = sum(v.dtype == tf.float32 for v in low.variables)
    assert [len(layer.trainable_weights) for layer in layers] == [float32, 4]
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        tf.compat.v1.saved_model.loader.load(session, ["serve"], str(_ok(converted, "tf1")))
        assert tf.compat.v1.trainable_variables() == []
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        tf.compat.v1.saved_model.loader.load(session, ["serve"], str(converted.src["tf1"]))
        assert [v.op.name for v in tf.compat.v1.trainable_variables()] == ["w"]
    told = ("  the bfloat16 ones are saved non-trainable (an update smaller than their precision rounds away): to"
            " fine-tune the result, convert with --float32-weights")
    assert told in converted.runs["module"].out.splitlines() and told in converted.runs["tf1"].out.splitlines()


def test_a_graph_def_over_2_gb_is_one_line_naming_the_limit_and_the_way(tmp_path: Path) -> None:
    """Rule: protobuf writes GraphDefs over 2 GB but cannot read them: the line says so and
    sends the user to a SavedModel, without reading the file (a sparse one here)."""
    big = tmp_path / "frozen.pb"
    with open(big, "wb") as file:
        file.truncate(2**31 + 1)
    line = error_line(run_cli("convert", big, tmp_path / "out.pb"))
    assert line == (f"amp-rewrite: error: {big}: 2.1 GB, and protobuf cannot read a GraphDef over 2 GB (it can write"
                    " one); save the model as a SavedModel, whose variables live outside the graph"
                    " (tf.saved_model.save, or model.export), and convert that")
    assert not (tmp_path / "out.pb").exists()


def test_a_big_checkpoint_shows_a_progress_bar_on_a_terminal_and_none_with_quiet(
        streamed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: on a terminal, writing a large checkpoint shows a bar over its bytes; --quiet shows none."""
    import io

    from amp_rewrite import cli
    from amp_rewrite.cli import convert

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(convert, "PROGRESS_BYTES", 1)
    for name, flags in (("shown", ()), ("quiet", ("--quiet",))):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        code = cli.main(["convert", str(streamed), str(tmp_path / name), "--target", "bfloat16", *flags])
        monkeypatch.undo()
        monkeypatch.setattr(convert, "PROGRESS_BYTES", 1)
        assert code == 0
        bar = [part for part in terminal.getvalue().split("\r") if "writing the checkpoint" in part]
        if flags:
            assert terminal.getvalue() == ""
        else:
            assert bar and "100%" in bar[-1], terminal.getvalue()


def test_a_tf1_saved_model_validates_in_a_session(converted: Models, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: a TF1 SavedModel is validated through TensorFlow's v1 loader (each variable
    restored in place), not tf.saved_model.load (every tensor restored before assigning)."""
    def refused(*_: Any, **__: Any) -> Any:
        raise AssertionError("tf.saved_model.load used for a TF1 SavedModel")

    monkeypatch.setattr(tf.saved_model, "load", refused)
    run = run_cli("convert", converted.src["tf1"], tmp_path / "dst", "--target", "bfloat16", "--validate", 2)
    assert_ok(run)
    assert re.search(r"^  ok   serving_default/y: max abs [0-9.e-]+, p99-rel [0-9.e-]+$", run.out, re.M), run.out


def test_a_graph_def_is_read_and_written_a_node_at_a_time_as_protobuf_would(converted: Models, tmp_path: Path) -> None:
    """Rule: the node-at-a-time reader gives protobuf's own message, the writer its
    deterministic bytes (library and versions included); a cut file is one line."""
    from amp_rewrite.calibration import savedmodel

    model = savedmodel.read_model(_ok(converted, "frozen"))
    expected = graph_pb2.GraphDef.FromString(converted.out["frozen"].read_bytes())
    assert model.graph_def == expected and len(expected.node) > 3
    expected.library.function.add().signature.name = "f"  # a field after the nodes
    savedmodel._write_proto(tmp_path / "written.pb", expected, text=False)
    assert (tmp_path / "written.pb").read_bytes() == expected.SerializeToString(deterministic=True)
    cut = tmp_path / "cut.pb"
    cut.write_bytes((tmp_path / "written.pb").read_bytes()[:-40])
    with pytest.raises(savedmodel.ModelError, match=r"cut\.pb: not a valid GraphDef \(.*\); is the file truncated\?$"):
        savedmodel.read_model(cut)


def test_a_saver_whose_name_list_is_too_short_is_one_line(converted: Models, tmp_path: Path) -> None:
    """Rule: a RestoreV2 whose tensor_names lists fewer keys than the outputs its graph reads
    (a malformed export) is exit 2 naming the op, not an IndexError."""
    broken = tmp_path / "short"
    subprocess.run(["cp", "-r", str(converted.src["tf1"]), str(broken)], check=True)
    proto = saved_model_pb2.SavedModel.FromString((broken / "saved_model.pb").read_bytes())
    names = next(node for node in proto.meta_graphs[0].graph_def.node if node.name == "save/RestoreV2/tensor_names")
    names.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.array([], dtype=object), dtype=tf.string))
    (broken / "saved_model.pb").write_bytes(proto.SerializeToString())
    line = error_line(run_cli("convert", broken, tmp_path / "dst", "--target", "bfloat16"))
    assert line == (f"amp-rewrite: error: {broken}: RestoreV2 'save/RestoreV2' in the main graph has tensor 0 but its"
                    " input 1 lists 0 name(s); the saver is malformed: export the model again")
    assert not (tmp_path / "dst").exists()
