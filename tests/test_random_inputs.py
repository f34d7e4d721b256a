"""Random validation inputs the model accepts, and outputs compared by what they are.

An integer input that indexes a table is drawn within the table's rows (``core.bounds``,
followed through casts, reshapes, constant offsets and calls); masks are padding masks; an
integer input no table bounds is drawn 0-9 with a note. Integer outputs are compared by
agreement (sequences: up to the first difference), floating ones by the chosen metric,
and ``--metric OUTPUT=NAME`` sets one output's. Graphs are small and hand-built where a
rule is checked; the CLI runs on Keras exports and, where keras_hub is installed, a BERT.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import amp_rewrite
from amp_rewrite.calibration import validate
from amp_rewrite.calibration.savedmodel import read_model
from amp_rewrite.core.bounds import index_bound
from amp_rewrite.core.program import program_of

from cli_models import write_graph_def
from test_cli import assert_ok, error_line, run_cli

SEGMENTS, VOCABULARY = 2, 50


def _graph(build: Callable[[tf.Tensor], tf.Tensor]) -> graph_pb2.GraphDef:
    """A graph of ``ids`` (an int32 placeholder) and ``build(ids)`` named ``out``."""
    with tf.Graph().as_default() as graph:
        ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
        tf.identity(build(ids), name="out")
    return graph.as_graph_def()


def _runs(graph_def: graph_pb2.GraphDef, ids: int) -> bool:
    """Whether the graph runs on CPU with every id ``ids``."""
    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        try:
            session.run("out:0", {"ids:0": np.full([3], ids, np.int32)})
        except tf.errors.InvalidArgumentError:
            return False
    return True


def _table(rows: int, name: str) -> tf.Tensor:
    return tf.constant(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2), name=name)


# --------------------------------------------------------------------------------------
# 1. Which values an integer input may take


def test_ids_through_cast_reshape_and_an_offset_are_bounded_by_the_rows_left_after_the_offset() -> None:
    """Rule: ids reach ``table10`` as cast(reshape(ids)) + 1: ids 0-8 are safe, 9 is not; the
    graph run agrees at both ends."""
    graph_def = _graph(lambda ids: tf.gather(_table(10, "table10"),
                                             tf.reshape(tf.cast(ids, tf.int64), [-1]) + tf.constant(1, tf.int64)))
    bound = index_bound(program_of(graph_def), "ids:0")
    assert (bound.low, bound.high) == (0, 9) and bound.table == "table 'table10' of 10 rows", bound
    assert _runs(graph_def, bound.high - 1) and not _runs(graph_def, bound.high)


def test_ids_less_a_constant_are_bounded_from_below_too() -> None:
    """Rule: 1 + (ids - 2) into ``table10`` (the constant first, then second): ids 1-10 are safe."""
    graph_def = _graph(lambda ids: tf.gather(_table(10, "table10"), 1 + (ids - 2)))
    bound = index_bound(program_of(graph_def), "ids:0")
    assert (bound.low, bound.high) == (1, 11), bound
    assert _runs(graph_def, 1) and _runs(graph_def, 10) and not _runs(graph_def, 0) and not _runs(graph_def, 11)


def test_ids_that_index_two_tables_take_the_smaller_one() -> None:
    """Rule: conservative: the tightest bound over every table the ids reach."""
    graph_def = _graph(lambda ids: tf.gather(_table(7, "table7"), ids) + tf.gather(_table(3, "table3"), ids))
    bound = index_bound(program_of(graph_def), "ids:0")
    assert (bound.high, bound.table) == (3, "table 'table3' of 3 rows"), bound
    assert _runs(graph_def, 2) and not _runs(graph_def, 3)


def test_ids_passed_into_a_function_are_bounded_by_a_table_passed_beside_them() -> None:
    """Rule: a call's arguments are followed into its body, and the table's shape back out
    to the caller's Const, as a SavedModel's signature passes its variables in."""
    @tf.function
    def lookup(table: tf.Tensor, ids: tf.Tensor) -> tf.Tensor:
        return tf.gather(table, tf.expand_dims(ids, 0))

    graph_def = _graph(lambda ids: lookup(_table(4, "table4"), ids))
    assert any(node.op in ("PartitionedCall", "StatefulPartitionedCall") for node in graph_def.node)
    bound = index_bound(program_of(graph_def), "ids:0")
    assert (bound.high, bound.table) == (4, "table 'table4' of 4 rows"), bound
    assert _runs(graph_def, 3) and not _runs(graph_def, 4)


def test_ids_carried_into_a_while_loop_are_bounded_by_the_table_its_body_reads() -> None:
    """Rule: a loop's inputs are its body's arguments, as a decode loop's token ids are."""
    def loop(ids: tf.Tensor) -> tf.Tensor:
        table = _table(6, "table6")
        return tf.while_loop(lambda i, ids, total: i < 2,
                             lambda i, ids, total: (i + 1, ids, total + tf.reduce_sum(tf.gather(table, ids))),
                             (tf.constant(0), ids, tf.constant(0.0)))[2]

    graph_def = _graph(loop)
    assert any(node.op in ("While", "StatelessWhile") for node in graph_def.node)
    bound = index_bound(program_of(graph_def), "ids:0")
    assert (bound.high, bound.table) == (6, "table 'table6' of 6 rows"), bound
    assert _runs(graph_def, 5) and not _runs(graph_def, 6)


def test_keras_negative_id_guard_keeps_the_branch_non_negative_ids_take() -> None:
    """Rule: ``where(ids < 0, ids + rows, ids)`` (Keras' ``take``) bounds ids by the table
    through its ``ids`` branch; an offset that is no constant bounds nothing."""
    def guarded(ids: tf.Tensor) -> tf.Tensor:
        rows = tf.shape(ids)[0] * 0 + 5
        return tf.gather(_table(5, "table5"), tf.where(ids < 0, ids + rows, ids))

    assert index_bound(program_of(_graph(guarded)), "ids:0").high == 5
    unguarded = _graph(lambda ids: tf.gather(_table(5, "table5"), ids + tf.shape(ids)[0]))
    assert index_bound(program_of(unguarded), "ids:0") is None


def test_one_hot_depth_bounds_and_arithmetic_alone_does_not() -> None:
    assert index_bound(program_of(_graph(lambda ids: tf.one_hot(ids, 6))), "ids:0").high == 6
    assert index_bound(program_of(_graph(lambda ids: tf.cast(ids * 2, tf.float32))), "ids:0") is None


def test_a_length_is_drawn_within_the_sequence_and_unbounded_ids_are_a_named_guess(tmp_path: Path) -> None:
    """Rule: ``lengths`` (indexing nothing) is 1 to the sequence's 5; ``codes`` reach no table:
    0-9, with a note naming them and asking for data."""
    with tf.Graph().as_default() as graph:
        codes = tf.compat.v1.placeholder(tf.int32, [None, 5], name="codes")
        lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
        tf.reduce_sum(codes * tf.cast(tf.sequence_mask(lengths, 5), tf.int32), axis=1, name="out")
    model = read_model(write_graph_def(graph.as_graph_def(), tmp_path / "lengths.pb"), ("out",))
    feeds, notes = validate.plan_feeds(model, None, 10)
    drawn = np.concatenate([feed["lengths"] for feed in feeds[validate.GRAPH]])
    assert drawn.min() >= 1 and drawn.max() <= 5 and len(set(drawn)) > 2, drawn
    assert len(notes) == 1 and notes[0].startswith("random inputs: codes feeds no table") and "--inputs" in notes[0]
    assert "lengths 1-5 (a length, up to the sequence's)" in validate.describe_draws(validate.plan_draws(model))


# --------------------------------------------------------------------------------------
# 2. A Keras model with two tables, a mask, a float and an integer output


@pytest.fixture(scope="module")
def keras_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Segment ids into a 2-row Embedding, token ids into a 50-row one, a padding mask;
    outputs ``logits`` (float) and ``cls`` (their argmax, int; a bias keeps the classes
    apart, so bfloat16's rounding flips none, on any CPU)."""
    import keras

    keras.utils.set_random_seed(0)
    segment = keras.Input((None,), dtype="int32", name="segment")
    token = keras.Input((None,), dtype="int32", name="token")
    mask = keras.Input((None,), dtype="int32", name="padding_mask")
    # Named: an unnamed layer's name counts the layers this process built before.
    x = (keras.layers.Embedding(SEGMENTS, 8, name="segment_embedding")(segment)
         + keras.layers.Embedding(VOCABULARY, 8, name="token_embedding")(token))
    x = x * keras.ops.expand_dims(keras.ops.cast(mask, "float32"), -1)
    classes = keras.layers.Dense(3, bias_initializer=keras.initializers.Constant([0.0, 0.3, 0.6]))  # no near-ties
    logits = classes(keras.layers.GlobalAveragePooling1D()(x))
    path = tmp_path_factory.mktemp("inputs") / "two_tables"
    keras.Model([segment, token, mask], {"logits": logits, "cls": keras.ops.argmax(logits, -1)}).export(
        str(path), verbose=False)
    keras.backend.clear_session()  # Keras' name counters as a fresh process has them, for the tests after these
    return path


def test_each_integer_input_is_drawn_within_its_table_and_the_mask_is_a_padding_mask(keras_model: Path) -> None:
    model = read_model(keras_model)
    draws = validate.plan_draws(model)
    assert {(d.kind, d.low, d.high) for (_, name), d in draws.items() if name == "segment"} == {("range", 0, SEGMENTS)}
    assert {(d.kind, d.low, d.high) for (_, name), d in draws.items() if name == "token"} == {("range", 0, VOCABULARY)}
    assert {d.kind for (_, name), d in draws.items() if name == "padding_mask"} == {"mask"}
    feeds, notes = validate.plan_feeds(model, None, 20, draws=draws)
    assert notes == []
    segments = np.concatenate([feed["segment"].ravel() for feed in feeds["serving_default"]])
    tokens = np.concatenate([feed["token"].ravel() for feed in feeds["serving_default"]])
    assert set(segments) == {0, 1} and 0 <= tokens.min() and tokens.max() < VOCABULARY and tokens.max() >= 10
    for feed in feeds["serving_default"]:
        for row in feed["padding_mask"]:
            ones = int(row.sum())
            assert ones >= 1 and list(row) == [1] * ones + [0] * (len(row) - ones), feed["padding_mask"]


def test_the_validation_says_the_ranges_and_names_each_outputs_metric(keras_model: Path, tmp_path: Path) -> None:
    """No --inputs: validates (ids 0-9 would overrun the 2-row table), the inputs line says
    the ranges; logits are measured by p99-rel, or max-rel where --metric names it, and
    cls (int) by agreement."""
    run = run_cli("convert", keras_model, tmp_path / "out", "--target", "bfloat16", "--validate", 2)
    assert_ok(run)
    assert (f"segment 0-{SEGMENTS - 1} (bounded by table 'segment_embedding/embeddings' of {SEGMENTS} rows)" in run.out
            and f"token 0-{VOCABULARY - 1} (bounded by table 'token_embedding/embeddings' of {VOCABULARY} rows)" in run.out
            and "padding_mask a padding mask" in run.out), run.out
    lines = {line.split()[1]: line for line in run.out.splitlines() if line.startswith("  ok ")}
    assert "p99-rel" in lines["serving_default/logits:"], run.out
    assert "agreement 1 (0 of 4 value(s) changed)" in lines["serving_default/cls:"], run.out
    again = run_cli("convert", keras_model, tmp_path / "again", "--target", "bfloat16", "--validate", 2,
                    "--metric", "serving_default/logits=max-rel")
    assert_ok(again)
    lines = {line.split()[1]: line for line in again.out.splitlines() if line.startswith("  ok ")}
    assert "max-rel" in lines["serving_default/logits:"] and "p99-rel" in lines["serve/logits:"], again.out


def test_a_metric_for_an_output_the_model_lacks_is_one_line_naming_its_outputs(keras_model: Path,
                                                                              tmp_path: Path) -> None:
    never = tmp_path / "never"
    line = error_line(run_cli("convert", keras_model, never, "--validate", 1, "--metric", "klass=agreement"))
    assert "--metric klass=agreement: the model has no output 'klass'; its outputs are 'cls', 'logits'" in line, line
    line = error_line(run_cli("convert", keras_model, tmp_path / "never", "--metric", "cls=same"))
    assert "'cls=same': use NAME or OUTPUT=NAME" in line, line
    assert not (tmp_path / "never").exists()


# --------------------------------------------------------------------------------------
# 3. Integer outputs compared by agreement


def _near_tie_graph_def() -> graph_pb2.GraphDef:
    """``logits`` = x @ [1, 1.0001] per row, ``cls`` their argmax: bfloat16 rounds 1.0001 to 1,
    so its argmax is 0 where float32's is 1 (every row whose sum is positive)."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        weights = tf.constant(np.tile([[1.0, 1.0001]], (4, 1)).astype(np.float32), name="weights")
        logits = tf.identity(tf.matmul(x, weights, name="allow1"), name="logits")  # a fetch keeps its dtype
        tf.argmax(logits, axis=1, name="cls")
    return graph.as_graph_def()


def test_an_integer_output_that_disagrees_fails_naming_it_and_its_agreement(tmp_path: Path) -> None:
    source = write_graph_def(_near_tie_graph_def(), tmp_path / "near_tie.pb")
    run = run_cli("convert", source, tmp_path / "out.pb", "--target", "bfloat16", "--fetch", "logits",
                  "--fetch", "cls", "--validate", 4)
    assert "validation failed for 1 output(s)" in error_line(run, code=1)
    lines = {line.split()[1]: line for line in run.out.splitlines() if line.split()[:1] in (["ok"], ["FAIL"])}
    assert lines["graph/logits:"].split()[0] == "ok" and "p99-rel" in lines["graph/logits:"], run.out
    cls = lines["graph/cls:"]
    assert cls.split()[:3] == ["FAIL", "graph/cls:", "agreement"], cls
    agreement = float(cls.split()[3])
    assert 0.2 < agreement < 0.8 and "value(s) changed" in cls, cls
    assert not (tmp_path / "out.pb").exists()


def test_integer_sequences_are_compared_up_to_their_first_difference_unless_an_output_is_named(
        tmp_path: Path) -> None:
    """``tokens`` (batch, 6): each position's near-tie class. By default a sequence, measured
    up to its first difference; ``--metric tokens=agreement`` counts every position instead,
    and the share kept is larger (a position after a flip may agree again)."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float32, [None, 6, 4], name="x")
        weights = tf.constant(np.tile([[1.0, 1.0001]], (4, 1)).astype(np.float32), name="weights")
        tf.argmax(tf.einsum("bsi,io->bso", x, weights, name="allow1"), axis=-1, name="tokens")
    source = write_graph_def(graph.as_graph_def(), tmp_path / "tokens.pb")
    common = ("--target", "bfloat16", "--fetch", "tokens", "--validate", 4)
    run = run_cli("convert", source, tmp_path / "out.pb", *common)
    assert "validation failed for 1 output(s)" in error_line(run, code=1)
    line = next(line for line in run.out.splitlines() if " graph/tokens:" in line)
    assert line.split()[:3] == ["FAIL", "graph/tokens:", "prefix-agreement"] and "sequence(s) identical" in line, line
    named = run_cli("convert", source, tmp_path / "out.pb", *common, "--metric", "tokens=agreement")
    assert "validation failed for 1 output(s)" in error_line(named, code=1)
    named_line = next(line for line in named.out.splitlines() if " graph/tokens:" in line)
    assert named_line.split()[:3] == ["FAIL", "graph/tokens:", "agreement"], named_line
    assert float(named_line.split()[3]) > float(line.split()[3]), (line, named_line)


def test_agreement_counts_values_and_prefix_agreement_stops_at_the_first_difference() -> None:
    """A generated sequence is lost after its first changed token, whatever follows."""
    reference = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    candidate = np.array([[1, 2, 9, 4], [5, 6, 7, 8]])
    assert validate.disagreement(reference, candidate) == 1 / 8
    assert validate.prefix_disagreement(reference, candidate) == 1 - (2 + 4) / 8
    assert validate.agreement_detail("prefix-agreement", [(reference, candidate)]) == (
        "1 of 2 sequence(s) identical, identical prefix 3 of 4 on average")
    choice = validate.MetricChoice()
    assert choice.for_output("s", "tokens", reference).name == "prefix-agreement"
    assert choice.for_output("s", "cls", reference[:, 0]).name == "agreement"
    assert choice.for_output("s", "logits", reference.astype(np.float32)).name == "p99-rel"
    assert validate.MetricChoice(by_output={"s/tokens": "agreement"}).for_output("s", "tokens", reference).name \
        == "agreement"


# --------------------------------------------------------------------------------------
# 4. A keras_hub BERT: segment ids index a 2-row table


def test_bert_backbone_validates_with_no_inputs(tmp_path: Path) -> None:
    """BertBackbone's segment_ids index a 2-row table (0-9 failed: "indices[0,0] = 3 is not in
    [0, 2)"); its token ids a vocabulary of 100; its padding mask is a mask."""
    keras_hub = pytest.importorskip("keras_hub")
    import keras

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=100, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=16)
    backbone.export(str(tmp_path / "bert"), verbose=False)
    keras.backend.clear_session()
    run = run_cli("convert", tmp_path / "bert", tmp_path / "bert_bf16", "--target", "bfloat16", "--validate", 2)
    assert_ok(run)
    assert ("segment_ids 0-1 (bounded by table 'segment_embedding/embeddings' of 2 rows)" in run.out
            and "token_ids 0-99 (bounded by table 'token_embedding/embeddings' of 100 rows)" in run.out
            and "padding_mask a padding mask" in run.out), run.out
    assert "ok   serving_default/sequence_output" in run.out, run.out


def test_calibration_measures_an_integer_output_by_agreement() -> None:
    """Rule: calibration's checks compare by what an output is, as validation does: the
    near-tie class ids that bfloat16 flips are a share changed, not a relative error."""
    calibration = amp_rewrite.calibrate(_near_tie_graph_def(), target="bfloat16", fetches=("logits", "cls"),
                                        max_rounds=1)
    checks = {check.output: check for check in calibration.rounds[0].checks}
    assert checks["cls"].metric == "agreement" and 0.2 < checks["cls"].error < 0.8, checks
    assert checks["logits"].metric == "" and checks["logits"].error < 0.01, checks


def test_two_signatures_with_the_same_inputs_get_the_same_random_batch(tmp_path: Path) -> None:
    """Rule: ``model.export`` writes ``serve`` and ``serving_default`` for one function; both
    are fed the same random values (one error per output, not two for one model), while an
    input only one signature has is drawn on its own."""
    module = tf.Module()
    module.scale = tf.Variable(2.0)
    double = tf.function(lambda x: {"y": x * module.scale}, input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
    other = tf.function(lambda z: {"y": z * module.scale}, input_signature=[tf.TensorSpec([None, 3], tf.float32, name="z")])
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={
        "serving_default": double, "serve": double.get_concrete_function(), "other": other})
    feeds, _ = validate.plan_feeds(read_model(tmp_path / "m"), None, 2)
    for run in range(2):
        np.testing.assert_array_equal(feeds["serve"][run]["x"], feeds["serving_default"][run]["x"])
        assert not np.array_equal(feeds["other"][run]["z"], feeds["serving_default"][run]["x"])
    assert not np.array_equal(feeds["serve"][0]["x"], feeds["serve"][1]["x"])
