"""Retargeting: a model that computes in float16 or bfloat16 already goes back to float32
first (``core/canonical.py``), then converts as its float32 twin would; ``--target float32``
stops there.

The key checks build a small CNN under a Keras mixed policy (its last layer float32, as
Keras' guide says), train it briefly on scikit-learn's digits, export it, and export its
float32 twin (the same layers under the float32 policy, ``set_weights`` from the mixed
one). Retargeting the mixed export must give the graph converting the twin gives: the same
nodes in the same dtypes, the same casts, compared by structure (node names differ between
the two exports), and the same outputs. The unit checks are small hand-built graphs whose
node names say what becomes of them.
"""
from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

import amp_rewrite
from amp_rewrite.calibration.savedmodel import read_model
from amp_rewrite.core import canonical as canonical_module
from amp_rewrite.core.canonical import low_dtypes, to_float32
from amp_rewrite.core.program import program_of
from amp_rewrite.errors import GraphError
from amp_rewrite.testing.digits import digits

from conftest import run_on_cpu
from test_cli import assert_ok, error_line, run_cli

CALL = re.compile(r"^__inference___call___\d+$")  # model.export's function holding the model
HALF, BF16, FLOAT = types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT


def _cnn() -> keras.Model:
    """Two convolutions, a batch norm, two dense layers; the last one float32 whatever the policy."""
    keras.utils.set_random_seed(0)
    pixels = keras.Input((64,))
    hidden = keras.layers.Reshape((8, 8, 1))(pixels)
    hidden = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(hidden)
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="relu")(hidden)
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(hidden))
    return keras.Model(pixels, keras.layers.Dense(10, dtype="float32")(hidden))


def _export_pair(directory: Path, policy: str) -> tuple[Path, Path]:
    """The CNN trained one epoch under ``policy`` and exported, and its float32 twin exported."""
    data = digits()
    keras.config.set_dtype_policy(policy)
    try:
        mixed = _cnn()
        mixed.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        mixed.fit(data.x_train, data.y_train, epochs=1, batch_size=64, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    twin = _cnn()
    twin.set_weights(mixed.get_weights())
    mixed.export(directory / policy, verbose=False)
    twin.export(directory / f"{policy}_twin", verbose=False)
    return directory / policy, directory / f"{policy}_twin"


@pytest.fixture(scope="module")
def mixed16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _export_pair(tmp_path_factory.mktemp("mixed16"), "mixed_float16")


@pytest.fixture(scope="module")
def mixed_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _export_pair(tmp_path_factory.mktemp("mixed_bf16"), "mixed_bfloat16")


@pytest.fixture(autouse=True)
def _float32_policy():
    """Each test starts and ends under Keras' float32 policy."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


def structure(graph_def: graph_pb2.GraphDef) -> collections.Counter:
    """Each node as what it computes, without names: its op, its dtypes and, recursively, its
    inputs' (an argument by its position). Two graphs with equal structures convert the same
    nodes to the same dtypes with the same casts between the same tensors."""
    nodes = {node.name: node for node in graph_def.node}
    keys: dict[str, tuple] = {}

    def key(name: str) -> tuple:
        if name not in keys:
            node = nodes[name]
            dtypes = tuple(sorted((attr, value.type) for attr, value in node.attr.items()
                                  if value.WhichOneof("value") == "type" and not attr.startswith("_")))
            place = node.attr["index"].i if node.op in ("_Arg", "_Retval") else -1
            data = tuple((key(ref.split(":")[0]), ref.rsplit(":", 1)[-1] if ":" in ref else "0")
                         for ref in node.input if not ref.startswith("^"))
            keys[name] = (node.op, dtypes, place, data)
        return keys[name]

    return collections.Counter(key(name) for name in nodes)


def model_body(path: Path, graph_def: graph_pb2.GraphDef | None = None) -> graph_pb2.GraphDef:
    """The body of the export's ``__call__`` function, of ``graph_def`` (default: the model's own)."""
    program = program_of(read_model(path).graph_def if graph_def is None else graph_def)
    (name,) = [name for name in program.library if CALL.match(name)]
    return program.item(name)


def cast_count(graph_def: graph_pb2.GraphDef) -> int:
    return sum(node.op == "Cast" for node in graph_def.node)


def serve(path: Path, x: np.ndarray) -> np.ndarray:
    loaded = tf.saved_model.load(str(path))  # held: its variables live as long as it does
    return loaded.serve(tf.constant(x)).numpy()


# --------------------------------------------------------------------------------------
# Keras mixed exports, retargeted, against their float32 twins


@pytest.mark.parametrize(("pair", "target"), [("mixed16", "bfloat16"), ("mixed_bf16", "float16")])
def test_retargeting_a_keras_mixed_export_equals_converting_its_float32_twin(
        request: pytest.FixtureRequest, tmp_path: Path, pair: str, target: str) -> None:
    """Same nodes converted, same casts, same outputs as the twin converted to ``target``."""
    mixed, twin = request.getfixturevalue(pair)
    run = run_cli("convert", mixed, tmp_path / "retargeted", "--target", target)
    assert_ok(run)
    source = "float16" if pair == "mixed16" else "bfloat16"
    assert re.match(rf"Model: retargeted from {source}: \d+ node\(s\) back to float32 first, \d+ cast\(s\)"
                    " removed", run.out.splitlines()[0]), run.out
    assert_ok(run_cli("convert", twin, tmp_path / "twin", "--target", target))
    retargeted, converted = model_body(tmp_path / "retargeted"), model_body(tmp_path / "twin")
    assert structure(retargeted) == structure(converted)
    assert cast_count(retargeted) == cast_count(converted) > 0
    target_dtype = HALF if target == "float16" else BF16
    assert any(node.attr["T"].type == target_dtype for node in retargeted.node if node.op in ("Conv2D", "MatMul"))
    x = digits().x_test[:16]
    np.testing.assert_allclose(serve(tmp_path / "retargeted", x), serve(tmp_path / "twin", x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pair", ["mixed16", "mixed_bf16"])
def test_target_float32_gives_the_float32_twin(request: pytest.FixtureRequest, tmp_path: Path, pair: str) -> None:
    """``--target float32``: the twin's graph, no low dtype left, its outputs to float32 rounding."""
    mixed, twin = request.getfixturevalue(pair)
    run = run_cli("convert", mixed, tmp_path / "f32", "--target", "float32")
    assert_ok(run)
    assert "Weights: float32, as they were" in run.out, run.out
    body = model_body(tmp_path / "f32")
    assert structure(body) == structure(model_body(twin))
    assert low_dtypes(read_model(tmp_path / "f32").graph_def) == {}
    assert low_dtypes(read_model(mixed).graph_def)  # the source did compute low
    x = digits().x_test[:16]
    np.testing.assert_allclose(serve(tmp_path / "f32", x), serve(twin, x), rtol=1e-5, atol=1e-6)


def test_target_float32_on_a_float32_model_says_so_and_writes_nothing(tmp_path: Path, mixed16: tuple[Path, Path]
                                                                      ) -> None:
    run = run_cli("convert", mixed16[1], tmp_path / "out", "--target", "float32")
    assert_ok(run)
    assert "already float32" in run.out and "nothing written" in run.out, run.out
    assert not (tmp_path / "out").exists()


def test_target_float32_refuses_options_that_convert(tmp_path: Path, mixed16: tuple[Path, Path]) -> None:
    line = error_line(run_cli("convert", mixed16[0], tmp_path / "out", "--target", "float32", "--keep", "dense"))
    assert "--keep: not with --target float32" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("first", ["bfloat16", "float16"])
def test_our_own_output_retargets_as_its_float32_source_converts(tmp_path: Path, mixed16: tuple[Path, Path],
                                                                 first: str) -> None:
    """A model we converted (weights kept float32) converted again to the other target, or to
    float32, is what converting the float32 source gives."""
    twin = mixed16[1]
    other = "float16" if first == "bfloat16" else "bfloat16"
    assert_ok(run_cli("convert", twin, tmp_path / "first", "--target", first, "--float32-weights"))
    for target, weights in ((other, ["--float32-weights"]), ("float32", [])):
        run = run_cli("convert", tmp_path / "first", tmp_path / target, "--target", target, *weights)
        assert_ok(run)
        assert run.out.startswith(f"Model: retargeted from {first}: "), run.out
    assert_ok(run_cli("convert", twin, tmp_path / "direct", "--target", other, "--float32-weights"))
    assert structure(model_body(tmp_path / other)) == structure(model_body(tmp_path / "direct"))
    assert structure(model_body(tmp_path / "float32")) == structure(model_body(twin))


# --------------------------------------------------------------------------------------
# Hand-placed casts: small graphs whose node names say what becomes of them


def _hand_cast_graph(output_dtype: tf.DType) -> graph_pb2.GraphDef:
    """x float32 -> cast to float16 -> matmul with a float16 constant -> relu -> output in
    ``output_dtype``; an int32 count cast to float16 and added."""
    @tf.function(input_signature=[tf.TensorSpec([2, 3], tf.float32), tf.TensorSpec([], tf.int32)])
    def model(x, count):
        low = tf.cast(x, tf.float16, name="to_low")
        weight = tf.constant(np.arange(12, dtype=np.float16).reshape(3, 4) / 8, name="weight_low")
        hidden = tf.nn.relu(tf.matmul(low, weight, name="matmul_low"), name="relu_low")
        hidden = hidden + tf.cast(count, tf.float16, name="int_cast_kept")
        return tf.identity(tf.cast(hidden, output_dtype, name="to_output"), name="out")  # returned as "Identity"

    return model.get_concrete_function().graph.as_graph_def()


def _run(graph_def: graph_pb2.GraphDef, x: np.ndarray, count: int) -> np.ndarray:
    return run_on_cpu(graph_def, ["Identity"], {"x": x, "count": np.int32(count)})[0]


def _expected(x: np.ndarray, count: int) -> np.ndarray:
    return np.maximum(x @ (np.arange(12, dtype=np.float32).reshape(3, 4) / 8), 0) + count


def test_hand_placed_casts_go_and_an_int_cast_stays() -> None:
    graph_def = _hand_cast_graph(tf.float32)
    result = to_float32(graph_def, fetches=["Identity"])
    nodes = {node.name: node for node in result.graph_def.node}
    assert "to_low" not in nodes and "to_output" not in nodes  # float casts that became identities
    assert nodes["int_cast_kept"].attr["SrcT"].type == types_pb2.DT_INT32
    assert nodes["int_cast_kept"].attr["DstT"].type == FLOAT
    for name in ("matmul_low", "relu_low"):
        assert nodes[name].attr["T"].type == FLOAT
    assert nodes["weight_low"].attr["dtype"].type == FLOAT
    assert list(nodes["matmul_low"].input)[0] == "x"
    assert (result.low_nodes, result.widened, result.casts_removed, result.casts_added) == ({"float16": 3}, 3, 2, 0)
    assert low_dtypes(result.graph_def) == {}
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(_run(result.graph_def, x, 3), _expected(x, 3), rtol=1e-6)


def test_a_float16_output_stays_float16_through_one_cast_at_the_end() -> None:
    graph_def = _hand_cast_graph(tf.float16)
    result = to_float32(graph_def, fetches=["Identity"])
    nodes = {node.name: node for node in result.graph_def.node}
    assert nodes["Identity"].attr["T"].type == HALF  # the output the client reads keeps its dtype
    (cast,) = [node for node in result.graph_def.node if node.op == "Cast" and node.attr["DstT"].type == HALF]
    assert nodes["Identity"].input[0] == cast.name and cast.attr["SrcT"].type == FLOAT
    assert nodes["relu_low"].attr["T"].type == nodes["out"].attr["T"].type == FLOAT
    assert result.casts_added == 1
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(_run(result.graph_def, x, 1), _expected(x, 1), rtol=1e-3)


def test_the_source_graph_is_not_modified_and_output_is_deterministic() -> None:
    graph_def = _hand_cast_graph(tf.float16)
    before = graph_def.SerializeToString(deterministic=True)
    first = to_float32(graph_def, fetches=["Identity"]).graph_def.SerializeToString(deterministic=True)
    assert graph_def.SerializeToString(deterministic=True) == before
    assert to_float32(graph_def, fetches=["Identity"]).graph_def.SerializeToString(deterministic=True) == first


def test_a_low_op_without_a_float32_kernel_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No registered op has float16 kernels and no float32 one; a stand-in registry says MatMul has."""
    real = canonical_module.support.has_kernel

    def has_kernel(node_def, attrs, device_type):
        return node_def.op != "MatMul" or attrs["T"].type != FLOAT and real(node_def, attrs, device_type)

    monkeypatch.setattr(canonical_module.support, "has_kernel", has_kernel)
    with pytest.raises(GraphError, match=r"node 'matmul_low' \(MatMul\) computes in float16 and its op has no"
                                         " float32 kernel"):
        to_float32(_hand_cast_graph(tf.float32), fetches=["Identity"])


def test_the_command_refuses_a_low_op_without_a_float32_kernel_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """The same stand-in registry, through ``convert --target float32``: exit 2, nothing written."""
    real = canonical_module.support.has_kernel
    monkeypatch.setattr(canonical_module.support, "has_kernel", lambda node_def, attrs, device_type: (
        node_def.op != "MatMul" or attrs["T"].type != FLOAT and real(node_def, attrs, device_type)))
    source = tmp_path / "low.pb"
    source.write_bytes(_hand_cast_graph(tf.float32).SerializeToString())
    for target in ("float32", "bfloat16"):
        line = error_line(run_cli("convert", source, tmp_path / "out.pb", "--target", target, "--fetch", "Identity"))
        assert f"{source}: node 'matmul_low' (MatMul) computes in float16 and its op has no float32 kernel" in line, \
            line
        assert not (tmp_path / "out.pb").exists()


def test_the_python_api_takes_target_float32() -> None:
    """``rewrite_graph_def(target="float32")`` is ``to_float32``'s graph; a colouring step refuses it."""
    graph_def = _hand_cast_graph(tf.float32)
    result = amp_rewrite.rewrite_graph_def(graph_def, target="float32", fetches=["Identity"])
    assert result.graph_def == amp_rewrite.to_float32(graph_def, fetches=["Identity"]).graph_def
    assert low_dtypes(result.graph_def) == {} and low_dtypes(graph_def) == {"float16": 3}
    with pytest.raises(amp_rewrite.AmpRewriteError, match="use amp_rewrite.to_float32"):
        amp_rewrite.load_lists("float32")


# --------------------------------------------------------------------------------------
# Weights stored low (our own outputs without --float32-weights)


def _checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Every variable value of a SavedModel's checkpoint, by key (the object graph's aside)."""
    reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_dtype_map() if "OBJECT_GRAPH" not in key}


def test_weights_stored_low_widen_exactly_to_float32(tmp_path: Path, mixed16: tuple[Path, Path]) -> None:
    assert_ok(run_cli("convert", mixed16[1], tmp_path / "bf16", "--target", "bfloat16"))
    source = _checkpoint(tmp_path / "bf16")
    low = {key for key, value in source.items() if value.dtype == tf.bfloat16.as_numpy_dtype}
    assert low  # the conversion stored weights in bfloat16
    run = run_cli("convert", tmp_path / "bf16", tmp_path / "f32", "--target", "float32")
    assert_ok(run)
    assert f"Weights: {len(low)} key(s) stored in bfloat16 widened to float32, exactly: the precision they lost" \
           " earlier is not recovered" in run.out, run.out
    widened = _checkpoint(tmp_path / "f32")
    for key in low:
        assert widened[key].dtype == np.float32
        np.testing.assert_array_equal(widened[key], source[key].astype(np.float32))
    loaded = tf.saved_model.load(str(tmp_path / "f32"))
    assert {variable.dtype for variable in loaded.variables} == {tf.float32}
    assert low_dtypes(read_model(tmp_path / "f32").graph_def) == {}
    x = digits().x_test[:8]
    np.testing.assert_allclose(serve(tmp_path / "f32", x), serve(tmp_path / "bf16", x), rtol=2e-2, atol=2e-2)


def test_float16_weights_retargeted_to_bfloat16_say_per_variable_what_changed(
        tmp_path: Path, mixed16: tuple[Path, Path]) -> None:
    assert_ok(run_cli("convert", mixed16[1], tmp_path / "fp16", "--target", "float16"))
    source = _checkpoint(tmp_path / "fp16")
    run = run_cli("convert", tmp_path / "fp16", tmp_path / "bf16", "--target", "bfloat16")
    assert_ok(run)
    written = _checkpoint(tmp_path / "bf16")
    found = dict(re.findall(r"^  (\S+): (\d+ of \d+) element\(s\) change", run.out, re.MULTILINE))
    assert found, run.out
    for key, value in written.items():
        if value.dtype != tf.bfloat16.as_numpy_dtype:
            continue
        assert source[key].dtype == np.float16
        expected = tf.cast(tf.cast(source[key], tf.float32), tf.bfloat16).numpy()
        np.testing.assert_array_equal(value, expected)  # rounded once, from the float16 values
    changed = sum(int(np.count_nonzero(written[key].astype(np.float32) != source[key].astype(np.float32)))
                  for key in written if written[key].dtype == tf.bfloat16.as_numpy_dtype)
    assert changed == sum(int(text.split(" of ")[0]) for text in found.values()) > 0  # 3 mantissa bits dropped


def _export_dense(path: Path, bias: float) -> Path:
    """A one-layer Dense model whose first bias is ``bias``."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="head")])
    kernel, biases = model.get_weights()
    biases[0] = bias
    model.set_weights([kernel, biases])
    model.export(path, verbose=False)
    return path


@pytest.mark.parametrize(("bias", "stored"), [(1e5, "99840"), (1e6, "999424")])  # as bfloat16 holds them
def test_a_value_beyond_float16_is_refused_naming_the_variable_unless_forced(tmp_path: Path, bias: float,
                                                                           stored: str) -> None:
    source = _export_dense(tmp_path / "dense", bias)
    assert_ok(run_cli("convert", source, tmp_path / "bf16", "--target", "bfloat16"))
    line = error_line(run_cli("convert", tmp_path / "bf16", tmp_path / "fp16", "--target", "float16"))
    assert re.search(rf"weight '(\w+/)?head/bias' holds {stored}, beyond float16's range", line), line
    assert "--force" in line and not (tmp_path / "fp16").exists()
    run = run_cli("convert", tmp_path / "bf16", tmp_path / "fp16", "--target", "float16", "--force")
    assert_ok(run)
    assert f"{stored} becomes inf (--force)" in run.out, run.out


def test_a_target_the_model_is_already_says_so_and_writes_nothing(tmp_path: Path) -> None:
    """Converted to bfloat16 (weights stored low, or kept float32), then to bfloat16 again: nothing to do."""
    source = _export_dense(tmp_path / "dense", 0.5)
    for weights in ([], ["--float32-weights"]):
        first = tmp_path / f"bf16{len(weights)}"
        assert_ok(run_cli("convert", source, first, "--target", "bfloat16", *weights))
        run = run_cli("convert", first, tmp_path / "again", "--target", "bfloat16", *weights)
        assert_ok(run)
        assert run.out.startswith("Model: already bfloat16: 0 nodes to convert"), run.out
        assert f"is bfloat16 already, its weights too: nothing to do, nothing written to {tmp_path / 'again'}" \
            in run.out, run.out
        assert not (tmp_path / "again").exists()


def test_low_weights_stay_low_where_the_run_loads_the_model_here(tmp_path: Path) -> None:
    """--calibrate runs the model as it is on disk: its low weights stay so, read through a
    cast, and the result loads and runs (validated)."""
    assert_ok(run_cli("convert", _export_dense(tmp_path / "dense", 0.5), tmp_path / "bf16", "--target", "bfloat16"))
    run = run_cli("convert", tmp_path / "bf16", tmp_path / "fp16", "--target", "float16", "--calibrate", "random",
                  "--validate", "1")
    assert_ok(run)
    assert "stay stored low as the source has them" in run.out, run.out
    loaded = tf.saved_model.load(str(tmp_path / "fp16"))
    assert {variable.dtype for variable in loaded.variables} == {tf.bfloat16}
    assert np.isfinite(loaded.serve(tf.ones((2, 4))).numpy()).all()


# --------------------------------------------------------------------------------------
# tf_keras mixed exports


def _tf_keras_pair(directory: Path) -> tuple[Path, Path]:
    """A tf_keras CNN under mixed_float16 (last layer float32) saved as a SavedModel, and its float32 twin."""
    tf_keras = pytest.importorskip("tf_keras")

    def build(policy: str) -> Any:
        tf_keras.mixed_precision.set_global_policy(policy)
        try:
            tf_keras.utils.set_random_seed(0)
            pixels = tf_keras.Input((64,), name="pixels")
            hidden = tf_keras.layers.Conv2D(8, 3, padding="same", activation="relu")(
                tf_keras.layers.Reshape((8, 8, 1))(pixels))
            hidden = tf_keras.layers.Dense(16, activation="relu")(tf_keras.layers.Flatten()(hidden))
            return tf_keras.Model(pixels, tf_keras.layers.Dense(10, dtype="float32")(hidden))
        finally:
            tf_keras.mixed_precision.set_global_policy("float32")

    mixed, twin = build("mixed_float16"), build("float32")
    twin.set_weights(mixed.get_weights())
    mixed.save(directory / "mixed", save_format="tf")
    twin.save(directory / "twin", save_format="tf")
    return directory / "mixed", directory / "twin"


def _serving(path: Path, x: np.ndarray) -> np.ndarray:
    loaded = tf.saved_model.load(str(path))
    (output,) = loaded.signatures["serving_default"](pixels=tf.constant(x)).values()
    return output.numpy()


def test_a_tf_keras_mixed_export_retargets_as_its_twin_converts(tmp_path: Path) -> None:
    mixed, twin = _tf_keras_pair(tmp_path)
    run = run_cli("convert", mixed, tmp_path / "retargeted", "--target", "bfloat16")
    assert_ok(run)
    assert run.out.startswith("Model: retargeted from float16: "), run.out
    assert re.search(r"^Model: converted [1-9]\d*/", run.out, re.MULTILINE), run.out
    assert_ok(run_cli("convert", twin, tmp_path / "direct", "--target", "bfloat16"))
    # The serving path computes as the twin's does. (The model totals differ: tf_keras' restored
    # layer functions keep their float16 signatures, so their arguments are cast at the boundary.)
    x = digits().x_test[:8]
    np.testing.assert_allclose(_serving(tmp_path / "retargeted", x), _serving(tmp_path / "direct", x), rtol=1e-6,
                               atol=1e-6)
    assert_ok(run_cli("convert", mixed, tmp_path / "f32", "--target", "float32"))
    np.testing.assert_allclose(_serving(tmp_path / "f32", x), _serving(twin, x), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# A frozen GraphDef whose weights are constants stored low


def _frozen_with_big_weight(path: Path) -> Path:
    """x (4x3) @ w (3x2, one value 1e5, the others small) -> relu, a .pb whose output is "out"."""
    @tf.function(input_signature=[tf.TensorSpec([4, 3], tf.float32, name="x")])
    def graph(x):
        weight = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2) / 3
        weight[0, 0] = 1e5
        return tf.nn.relu(tf.matmul(x, tf.constant(weight, name="w"), name="matmul"), name="out")

    path.write_bytes(graph.get_concrete_function().graph.as_graph_def().SerializeToString(deterministic=True))
    return path


def _constant(path: Path, name: str) -> np.ndarray:
    graph_def = graph_pb2.GraphDef.FromString(path.read_bytes())
    return tf.make_ndarray(next(node for node in graph_def.node if node.name == name).attr["value"].tensor)


def test_frozen_constants_stored_low_widen_exactly_and_refuse_what_float16_cannot_hold(tmp_path: Path) -> None:
    source = _frozen_with_big_weight(tmp_path / "f32.pb")
    fetch = ["--fetch", "out"]
    assert_ok(run_cli("convert", source, tmp_path / "bf16.pb", "--target", "bfloat16", *fetch))
    low = _constant(tmp_path / "bf16.pb", "w")
    assert low.dtype == tf.bfloat16.as_numpy_dtype
    line = error_line(run_cli("convert", tmp_path / "bf16.pb", tmp_path / "fp16.pb", "--target", "float16", *fetch))
    assert "weight 'w' holds 99840, beyond float16's range" in line, line
    assert not (tmp_path / "fp16.pb").exists()
    run = run_cli("convert", tmp_path / "bf16.pb", tmp_path / "back.pb", "--target", "float32", *fetch)
    assert_ok(run)
    assert "Weights: 1 constant(s) stored in bfloat16 widened to float32, exactly" in run.out, run.out
    widened = _constant(tmp_path / "back.pb", "w")
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened, low.astype(np.float32))


def _block(dtype: tf.DType) -> graph_pb2.GraphDef:
    """A dense block computing in ``dtype`` between float32 input and output (casts where
    ``dtype`` is low, none in float32): what a mixed policy and its float32 twin trace."""
    @tf.function(input_signature=[tf.TensorSpec([2, 3], tf.float32, name="x")])
    def block(x):
        kernel = tf.constant(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
        hidden = tf.nn.relu(tf.matmul(tf.cast(x, dtype), tf.cast(kernel, dtype)) + tf.cast(0.5, dtype))
        return tf.cast(tf.reduce_sum(hidden, axis=1), tf.float32)

    return block.get_concrete_function().graph.as_graph_def()


@pytest.mark.parametrize("low", [tf.float16, tf.bfloat16])
def test_the_api_retargets_a_mixed_graph_as_it_converts_the_float32_one(low: tf.DType) -> None:
    """``rewrite_graph_def(to_float32(g).graph_def, ...)`` is the float32 twin's rewrite."""
    fetches = ["Identity"]
    canonical = to_float32(_block(low), fetches=fetches).graph_def
    assert structure(canonical) == structure(_block(tf.float32))
    for target in ("float16", "bfloat16"):
        retargeted = amp_rewrite.rewrite_graph_def(canonical, target=target, fetches=fetches).graph_def
        direct = amp_rewrite.rewrite_graph_def(_block(tf.float32), target=target, fetches=fetches).graph_def
        assert structure(retargeted) == structure(direct)


def test_a_cast_from_a_float16_input_stays_as_it_is() -> None:
    """A float16 placeholder (a signature input) read through a cast to float32: the cast
    stays as written, no second cast beside it; the float16 relu after the input widens."""
    @tf.function(input_signature=[tf.TensorSpec([2], tf.float16, name="x16")])
    def graph(x16):
        low = tf.nn.relu(x16, name="relu_low")
        return tf.cast(x16, tf.float32, name="input_cast_kept") + tf.cast(low, tf.float32, name="to_float32")

    result = to_float32(graph.get_concrete_function().graph.as_graph_def(), fetches=["Identity"])
    nodes = {node.name: node for node in result.graph_def.node}
    cast = nodes["input_cast_kept"]
    assert (cast.attr["SrcT"].type, cast.attr["DstT"].type, list(cast.input)) == (HALF, FLOAT, ["x16"])
    assert nodes["relu_low"].attr["T"].type == FLOAT and "to_float32" not in nodes
    assert (result.widened, result.casts_removed, result.casts_added) == (1, 1, 1)  # x16 -> relu: one cast
