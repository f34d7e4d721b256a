"""``convert --outputs float32``: every floating output of every signature float32, after any
retargeting or conversion; without it each output keeps the dtype the source's signature has.

The signatures' dtypes, the signature functions and the functions they return from, their
calls, and the object graph's output specs change together: checked by loading the result
(``tf.saved_model.load``: ``loaded.signatures[...]``, its ``structured_outputs``, a restored
function) and through a TF1 session as a server reads a SavedModel (the signature's tensor
names in the main graph), and by comparing outputs with the float32 twin's.
"""
from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2

import amp_rewrite
from amp_rewrite.core.canonical import to_float32
from conftest import run_on_cpu
from test_cli import assert_ok, error_line, run_cli
from test_retarget import _expected, _hand_cast_graph, model_body, serve, structure

X = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)


def _dense_pair(directory: Path) -> tuple[Path, Path]:
    """Two Dense layers built under ``mixed_float16``, the last one float16 too (no float32
    final layer: the export's output is float16), exported; and its float32 twin."""
    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        mixed = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    finally:
        keras.config.set_dtype_policy("float32")
    twin = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    twin.set_weights(mixed.get_weights())
    mixed.export(directory / "mixed16", verbose=False)
    twin.export(directory / "twin", verbose=False)
    return directory / "mixed16", directory / "twin"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _dense_pair(tmp_path_factory.mktemp("outputs"))


class _TwoSignatures(tf.Module):
    """Two signatures computing in float16: ``a`` returns a float16 and an int32 output, ``b`` one float16."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(1).standard_normal((8, 3)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec((None, 8), tf.float32)])
    def a(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.matmul(tf.cast(x, tf.float16), tf.cast(self.w, tf.float16)), "z": tf.cast(x > 0, tf.int32)}

    @tf.function(input_signature=[tf.TensorSpec((None, 8), tf.float32)])
    def b(self, x: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(tf.matmul(tf.cast(x, tf.float16), tf.cast(self.w, tf.float16)))


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("module") / "two"
    saved = _TwoSignatures()
    tf.saved_model.save(saved, str(path), signatures={"a": saved.a, "b": saved.b})
    return path


def _signature_dtypes(path: Path) -> dict[str, dict[str, str]]:
    """Per signature, each output's dtype as a call returns it, checked against what
    ``structured_outputs`` and the SavedModel's signature_def say."""
    loaded = tf.saved_model.load(str(path))
    proto = saved_model_pb2.SavedModel.FromString((path / "saved_model.pb").read_bytes())
    defs = proto.meta_graphs[0].signature_def
    found = {}
    for key, function in loaded.signatures.items():
        returned = {name: value.dtype.name for name, value in function(tf.constant(X)).items()}
        assert returned == {name: spec.dtype.name for name, spec in function.structured_outputs.items()}
        assert returned == {name: tf.as_dtype(info.dtype).name for name, info in defs[key].outputs.items()}
        found[key] = returned
    return found


def _session_outputs(path: Path) -> dict[str, dict[str, np.ndarray]]:
    """Each signature run as a server runs it: a TF1 session on the main graph, by the signature's tensor names."""
    with tf.compat.v1.Session(graph=tf.Graph()) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path))
        return {key: session.run({name: info.name for name, info in signature.outputs.items()},
                                 {info.name: X for info in signature.inputs.values()})
                for key, signature in meta.signature_def.items() if not key.startswith("__")}


def test_a_mixed_float16_export_back_to_float32_with_float32_outputs_is_its_twin(
        pair: tuple[Path, Path], tmp_path: Path) -> None:
    mixed, twin = pair
    assert _signature_dtypes(mixed) == {"serve": {"output_0": "float16"}, "serving_default": {"output_0": "float16"}}
    run = run_cli("convert", mixed, tmp_path / "f32", "--target", "float32", "--outputs", "float32")
    assert_ok(run)
    assert "Outputs: 2 signature output(s) made float32 (--outputs float32): serve/output_0," \
           " serving_default/output_0" in run.out, run.out
    assert _signature_dtypes(tmp_path / "f32") == _signature_dtypes(twin)
    assert structure(model_body(tmp_path / "f32")) == structure(model_body(twin))  # no float16 round trip left
    expected = serve(twin, X)
    assert serve(tmp_path / "f32", X).dtype == np.float32  # the restored function too
    np.testing.assert_allclose(serve(tmp_path / "f32", X), expected, rtol=1e-5, atol=1e-6)
    for outputs in _session_outputs(tmp_path / "f32").values():
        assert outputs["output_0"].dtype == np.float32
        np.testing.assert_allclose(outputs["output_0"], expected, rtol=1e-5, atol=1e-6)


def test_without_the_flag_outputs_keep_the_source_dtypes(pair: tuple[Path, Path], tmp_path: Path) -> None:
    mixed, twin = pair
    for source, target, expected in ((mixed, "float32", "float16"), (mixed, "bfloat16", "float16"),
                                     (twin, "float16", "float32"), (twin, "bfloat16", "float32")):
        destination = tmp_path / f"{source.name}-{target}"
        run = run_cli("convert", source, destination, "--target", target)
        assert_ok(run)
        assert "Outputs:" not in run.out, run.out
        assert {dtypes["output_0"] for dtypes in _signature_dtypes(destination).values()} == {expected}, destination


def test_retargeting_with_float32_outputs_converts_as_the_twin_does(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """float16 -> bfloat16 with --outputs float32 is the float32 twin converted to bfloat16 (whose outputs stay float32)."""
    mixed, twin = pair
    assert_ok(run_cli("convert", mixed, tmp_path / "bf16", "--target", "bfloat16", "--outputs", "float32",
                      "--float32-weights"))
    assert_ok(run_cli("convert", twin, tmp_path / "twin", "--target", "bfloat16", "--float32-weights"))
    assert structure(model_body(tmp_path / "bf16")) == structure(model_body(tmp_path / "twin"))
    assert _signature_dtypes(tmp_path / "bf16") == _signature_dtypes(tmp_path / "twin")
    np.testing.assert_array_equal(serve(tmp_path / "bf16", X), serve(tmp_path / "twin", X))


def test_float32_outputs_already_says_so(pair: tuple[Path, Path], tmp_path: Path) -> None:
    run = run_cli("convert", pair[1], tmp_path / "fp16", "--target", "float16", "--outputs", "float32")
    assert_ok(run)
    assert "Outputs: every floating signature output is float32 already" in run.out, run.out
    assert {dtypes["output_0"] for dtypes in _signature_dtypes(tmp_path / "fp16").values()} == {"float32"}


@pytest.mark.parametrize("target", ["float32", "bfloat16", "float16"])
def test_a_module_with_two_signatures_gets_float32_floating_outputs(module: Path, tmp_path: Path, target: str) -> None:
    """Its int32 output stays int32; its restored functions return float32 too; values as the source's."""
    source = _session_outputs(module)
    assert _signature_dtypes(module) == {"a": {"y": "float16", "z": "int32"}, "b": {"output_0": "float16"}}
    run = run_cli("convert", module, tmp_path / target, "--target", target, "--outputs", "float32")
    assert_ok(run)
    assert "Outputs: 2 signature output(s) made float32 (--outputs float32): a/y, b/output_0" in run.out, run.out
    assert _signature_dtypes(tmp_path / target) == {"a": {"y": "float32", "z": "int32"}, "b": {"output_0": "float32"}}
    loaded = tf.saved_model.load(str(tmp_path / target))
    assert loaded.a(tf.constant(X))["y"].dtype == loaded.b(tf.constant(X)).dtype == tf.float32
    served = _session_outputs(tmp_path / target)
    tolerance = 2e-2 if target == "bfloat16" else 2e-3  # float16's weights and products, or bfloat16's
    for key, outputs in source.items():
        for name, value in outputs.items():
            np.testing.assert_allclose(served[key][name], value.astype(served[key][name].dtype), rtol=tolerance,
                                       atol=tolerance)
    np.testing.assert_array_equal(served["a"]["z"], source["a"]["z"])


def test_a_graph_def_with_a_float16_output_is_refused(tmp_path: Path) -> None:
    @tf.function(input_signature=[tf.TensorSpec((None, 8), tf.float32, name="x")])
    def low(x: tf.Tensor) -> tf.Tensor:
        return tf.identity(tf.nn.relu(tf.cast(x, tf.float16)), name="out")

    path = tmp_path / "low.pb"
    path.write_bytes(low.get_concrete_function().graph.as_graph_def().SerializeToString())
    line = error_line(run_cli("convert", path, tmp_path / "out.pb", "--target", "float32", "--outputs", "float32",
                              "--fetch", "out"))
    assert "--outputs float32 changes a SavedModel's signatures" in line and "'out' is float16" in line, line
    assert not (tmp_path / "out.pb").exists()


def test_the_python_api_equivalent_leaves_the_output_out_of_fetches() -> None:
    """``to_float32`` keeps the dtypes of ``fetches``: an output left out goes back to float32,
    and a rewrite that then keeps it (as ``fetches``) leaves it float32."""
    graph_def = _hand_cast_graph(tf.float16)
    kept, widened = to_float32(graph_def, fetches=["Identity"]), to_float32(graph_def)
    dtype = {name: {node.name: node for node in result.graph_def.node}["Identity"].attr["T"].type
             for name, result in (("kept", kept), ("widened", widened))}
    assert dtype == {"kept": types_pb2.DT_HALF, "widened": types_pb2.DT_FLOAT}
    converted = amp_rewrite.rewrite_graph_def(widened.graph_def, target="bfloat16", fetches=["Identity"])
    for result, expected in ((kept, tf.float16), (widened, tf.float32), (converted, tf.float32)):
        with tf.Graph().as_default() as graph:
            tf.graph_util.import_graph_def(result.graph_def, name="")
        assert graph.get_tensor_by_name("Identity:0").dtype == expected
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    output = run_on_cpu(widened.graph_def, ["Identity"], {"x": x, "count": np.int32(2)})[0]
    np.testing.assert_allclose(output, _expected(x, 2), rtol=1e-6)  # float32 to the end


def _tf1_saved_model(path: Path) -> tuple[Path, np.ndarray]:
    """A TF1 SavedModel (its signature names main-graph tensors) computing relu(x @ w) in
    float16, output "y" float16; and w."""
    weight = np.random.default_rng(2).standard_normal((8, 3)).astype(np.float32)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        x = tf.compat.v1.placeholder(tf.float32, (None, 8), name="x")
        w = tf.compat.v1.get_variable("w", initializer=weight, use_resource=True)
        y = tf.nn.relu(tf.matmul(tf.cast(x, tf.float16), tf.cast(w, tf.float16)), name="y")
        session.run(tf.compat.v1.global_variables_initializer())
        builder = tf.compat.v1.saved_model.Builder(str(path))
        signature = tf.compat.v1.saved_model.predict_signature_def({"x": x}, {"y": y})
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={"serving_default": signature})
        builder.save()
    return path, weight


def test_a_tf1_signature_output_becomes_float32_without_a_float16_round_trip(tmp_path: Path) -> None:
    source, weight = _tf1_saved_model(tmp_path / "tf1")
    expected = np.maximum(X @ weight, 0)
    assert np.abs(_session_outputs(source)["serving_default"]["y"] - expected).max() > 1e-4  # float16's rounding
    run = run_cli("convert", source, tmp_path / "f32", "--target", "float32", "--outputs", "float32")
    assert_ok(run)
    assert "Outputs: 1 signature output(s) made float32 (--outputs float32): serving_default/y" in run.out, run.out
    served = _session_outputs(tmp_path / "f32")["serving_default"]["y"]
    assert served.dtype == np.float32
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    assert _signature_dtypes(tmp_path / "f32") == {"serving_default": {"y": "float32"}}
