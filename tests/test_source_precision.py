"""The source's precision, said first: what a model already computes in and stores, read from
its graph (``core/precision.py``), on hand-built graphs whose node names say whether they
count, and on the exports users arrive with — Keras 3 float32, ``mixed_float16`` and
``mixed_bfloat16``, tf_keras ``mixed_float16``, and our own bfloat16 output — each trained
briefly on scikit-learn's digits. ``inspect`` opens with the line, ``dump`` too, and its
report.html."""
from __future__ import annotations

import html
from pathlib import Path

import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite.calibration.savedmodel import plumbing_kinds, read_model
from amp_rewrite.core.graph_io import make_node_def
from amp_rewrite.core.precision import source_precision
from amp_rewrite.testing.digits import digits
from test_cli import assert_ok, run_cli

KERAS_LINE = "Source: computes {count} nodes in {dtype}, variables float32: a Keras mixed_{dtype} export?"


# --------------------------------------------------------------------------------------
# Hand-built graphs: which nodes count


def _matmul_graph(cast_name: str, *, variable: str = "resource") -> graph_pb2.GraphDef:
    """x (float32) and a float32 variable, each cast to float16, into ``low_matmul`` and
    ``low_relu``; ``variable="ref"`` holds it as a TF1 VariableV2 read by Identity."""
    graph_def = graph_pb2.GraphDef()
    half, single = types_pb2.DT_HALF, types_pb2.DT_FLOAT
    make_node_def("Placeholder", "x", dtype=single, into=graph_def.node)
    if variable == "ref":
        make_node_def("VariableV2", "w", dtype=single, shape=[4, 4], into=graph_def.node)
        make_node_def("Identity", "read", ["w"], T=single, into=graph_def.node)
    else:
        make_node_def("VarHandleOp", "w", dtype=single, shape=[4, 4], into=graph_def.node)
        make_node_def("ReadVariableOp", "read", ["w"], dtype=single, into=graph_def.node)
    make_node_def("Cast", "cast_x", ["x"], SrcT=single, DstT=half, into=graph_def.node)
    make_node_def("Cast", cast_name, ["read"], SrcT=single, DstT=half, into=graph_def.node)
    make_node_def("MatMul", "low_matmul", ["cast_x", cast_name], T=half, into=graph_def.node)
    make_node_def("Relu", "low_relu", ["low_matmul"], T=half, into=graph_def.node)
    make_node_def("Identity", "out", ["low_relu"], T=half, into=graph_def.node)
    return graph_def


@pytest.mark.parametrize("variable", ["resource", "ref"])
def test_float32_masters_cast_low_read_as_a_keras_mixed_export(variable: str) -> None:
    """Only the nodes named low_* compute (casts, reads and identities do not); a float32
    variable read and cast at once to float16 is the Keras mixed policy's pattern."""
    found = source_precision(_matmul_graph("master_cast", variable=variable))
    assert found.compute == {"float16": 2} and found.variables == {"float32": 1}
    assert (found.master_casts, found.rewrite_casts) == (1, 0)
    assert found.line() == KERAS_LINE.format(count=2, dtype="float16")


def test_casts_named_as_the_rewrite_names_them_say_a_rewrite() -> None:
    found = source_precision(_matmul_graph("read-0-CastToFp16-0-AutoMixedPrecision"))
    assert found.rewrite_casts == 1
    assert found.line() == ("Source: computes 2 nodes in float16, variables float32: an amp_rewrite (or grappler)"
                            " float16 rewrite")


def test_skipped_items_do_not_count() -> None:
    """TensorFlow's plumbing (the loader graph of a SavedModel) is left out when named."""
    assert source_precision(_matmul_graph("master_cast"), skip={""}).line() == (
        "Source: float32 (no node computes in float16 or bfloat16)")


# --------------------------------------------------------------------------------------
# Real exports


def _train_and_export(path: Path, policy: str, *, tf_keras: bool = False) -> Path:
    """A small CNN built under ``policy`` (its logits layer float32, as Keras' guide advises),
    trained one epoch on the digits, exported as a SavedModel."""
    if tf_keras:
        import tf_keras as keras  # a test extra: the tf_keras path of the tests
        set_policy = keras.mixed_precision.set_global_policy
    else:
        import keras
        set_policy = keras.config.set_dtype_policy
    data = digits()
    set_policy(policy)
    try:
        layers = keras.layers
        model = keras.Sequential([keras.Input((64,)), layers.Reshape((8, 8, 1)),
                                  layers.Conv2D(8, 3, activation="relu"), layers.Flatten(),
                                  layers.Dense(16, activation="relu"), layers.Dense(10, dtype="float32")])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(data.x_train, data.y_train, batch_size=64, epochs=1, verbose=0)
        if tf_keras:
            tf.saved_model.save(model, str(path))
        else:
            model.export(str(path), verbose=False)
    finally:
        set_policy("float32")
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    found = {policy: _train_and_export(root / policy, policy)
             for policy in ("float32", "mixed_float16", "mixed_bfloat16")}
    found["tf_keras mixed_float16"] = _train_and_export(root / "tfk16", "mixed_float16", tf_keras=True)
    for name, extra in (("ours bfloat16", ()), ("ours bfloat16, float32 weights", ("--float32-weights",))):
        found[name] = root / name.replace(" ", "_").replace(",", "")
        assert_ok(run_cli("convert", found["float32"], found[name], "--target", "bfloat16", *extra))
    return found


def _precision(path: Path):
    model = read_model(path)
    return source_precision(model.graph_def, skip=plumbing_kinds(model))


@pytest.mark.parametrize("name, compute, variables, origin", [
    ("float32", set(), {"float32"}, ""),
    ("mixed_float16", {"float16"}, {"float32"}, "a Keras mixed_float16 export?"),
    ("mixed_bfloat16", {"bfloat16"}, {"float32"}, "a Keras mixed_bfloat16 export?"),
    ("tf_keras mixed_float16", {"float16"}, {"float32"}, "a Keras mixed_float16 export?"),
    ("ours bfloat16", {"bfloat16"}, {"bfloat16"}, "an amp_rewrite (or grappler) bfloat16 rewrite"),
    ("ours bfloat16, float32 weights", {"bfloat16"}, {"float32"}, "an amp_rewrite (or grappler) bfloat16 rewrite"),
])
def test_exports_say_what_they_compute_in_and_store(exports: dict[str, Path], name: str, compute: set[str],
                                                    variables: set[str], origin: str) -> None:
    found = _precision(exports[name])
    assert set(found.compute) == compute and set(found.variables) == variables, found
    assert found.origin == origin, found


def test_both_keras_policies_and_both_kerases_count_the_same_nodes(exports: dict[str, Path]) -> None:
    """One architecture, one count: the policy changes the dtype, not which nodes compute in it;
    tf_keras's export runs the same layers (its per-layer functions that no signature runs are not counted)."""
    counts = {name: sum(_precision(exports[name]).compute.values())
              for name in ("mixed_float16", "mixed_bfloat16", "tf_keras mixed_float16")}
    # Conv2D, MatMul, their BiasAdds and Relus: the reshapes and shapes each Keras places its own way do not count
    assert set(counts.values()) == {6}, counts


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_inspect_opens_with_what_the_file_is_whatever_the_target(exports: dict[str, Path], target: str) -> None:
    """Retargeting to bfloat16 takes the graph back to float32 first: the line still says what the file computes in."""
    expected = _precision(exports["mixed_float16"]).line()
    assert expected.startswith("Source: computes ") and expected.endswith("a Keras mixed_float16 export?")
    run = run_cli("inspect", exports["mixed_float16"], "--target", target)
    assert_ok(run)
    assert run.out.splitlines()[0] == expected, run.out


@pytest.mark.parametrize("name, target", [("float32", "float16"), ("mixed_bfloat16", "float16")])
def test_dump_and_its_report_open_with_the_line(exports: dict[str, Path], tmp_path: Path, name: str,
                                                target: str) -> None:
    expected = _precision(exports[name]).line()
    run = run_cli("dump", exports[name], tmp_path / "dump", "--target", target)
    assert_ok(run)
    assert run.out.splitlines()[0] == expected, run.out
    page = html.unescape((tmp_path / "dump" / "report.html").read_text(encoding="utf-8"))
    assert f'<p class="source">{expected}</p>' in page


def test_inspect_quiet_keeps_the_headline_alone(exports: dict[str, Path]) -> None:
    run = run_cli("inspect", exports["ours bfloat16"], "--target", "bfloat16", "--quiet")
    assert_ok(run)
    assert len(run.out.splitlines()) == 1 and run.out.startswith("Model: already bfloat16"), run.out
