"""A frozen GraphDef converted with its large constants left in the file (calibration/frozen.py):
the result is the file the in-memory conversion writes, byte for byte, and no read ever
holds a large constant's values; what colouring reads is read, a cut file is one line.

Every test forces a low threshold for "large" (``frozen.LARGE_BYTES``), so a tiny graph has
several large constants, and reads a chunk of values at a time (``frozen.CHUNK_BYTES``).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite.calibration import frozen, savedmodel
from amp_rewrite.core.graph_io import LEFT_IN_FILE

from cli_models import write_graph_def
from test_cli import assert_ok, error_line, listing, run_cli

WIDTH = 16
KERNEL_BYTES = WIDTH * WIDTH * 4    # each kernel's tensor_content
LARGE = 64                          # the test's "large": the kernels and the Mul's factor (WIDTH floats)
CHUNK = 256
KERNELS = ("dense0/kernel", "dense1/kernel", "dense2/kernel")


def _frozen_chain() -> graph_pb2.GraphDef:
    """x -> 3 x (MatMul by a Const kernel, Relu) -> y, and exp(relu(h) * c) times the last kernel
    -> z, with a Const ``c`` of non-positive values: colouring reads ``c`` (Exp acts as an infer
    op there, converted between the MatMuls)."""
    rng = np.random.default_rng(0)
    with tf.Graph().as_default() as graph:
        h = tf.compat.v1.placeholder(tf.float32, [None, WIDTH], name="x")
        for name in KERNELS:
            kernel = tf.constant(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), name=name)
            h = tf.nn.relu(tf.matmul(h, kernel))
        tf.identity(h, name="y")
        factor = tf.constant(-np.abs(rng.standard_normal(WIDTH)).astype(np.float32), name="c")
        tf.identity(tf.matmul(tf.exp(tf.nn.relu(h) * factor, name="exp"), kernel), name="z")
    return graph.as_graph_def()


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(frozen, "LARGE_BYTES", LARGE)
    monkeypatch.setattr(frozen, "CHUNK_BYTES", CHUNK)
    return write_graph_def(_frozen_chain(), tmp_path / "frozen.pb")


def _reference(source: Path, destination: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> bytes:
    """The conversion with every value read into memory (nothing is large)."""
    with monkeypatch.context() as patch:
        patch.setattr(frozen, "LARGE_BYTES", 1 << 40)
        assert_ok(run_cli("convert", source, destination, *flags))
    return destination.read_bytes()


def test_reading_leaves_each_large_constant_in_the_file_but_what_colouring_reads(source: Path) -> None:
    """Rule: the graph read holds the mark in place of each large kernel's values (their place
    in the file kept), and the values of a Mul's constant factor, which colouring reads."""
    model = savedmodel.read_model(source, constants_in_file=True)
    nodes = {node.name: node for node in model.graph_def.node}
    assert set(model.left_in_file.contents) == set(KERNELS)
    data = source.read_bytes()
    expected = {node.name: node.attr["value"].tensor.tensor_content for node in _frozen_chain().node}
    for name, content in model.left_in_file.contents.items():
        assert nodes[name].attr["value"].tensor.tensor_content == LEFT_IN_FILE
        assert data[content.offset:content.offset + content.length] == expected[name]
        assert content.length == KERNEL_BYTES and content.dtype == types_pb2.DT_FLOAT
    assert nodes["c"].attr["value"].tensor.tensor_content == expected["c"]
    assert savedmodel.read_model(source).left_in_file is None  # by default every value is read


@pytest.mark.parametrize("flags", [("--target", "bfloat16"), ("--target", "float16"),
                                   ("--target", "bfloat16", "--float32-weights")])
def test_the_streamed_result_is_the_in_memory_one_byte_for_byte(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...]) -> None:
    """Rule: convert writes the bytes the in-memory conversion writes (kernels rounded to the
    target, or copied with --float32-weights), and no read of the source holds a kernel's values."""
    reads: list[int] = []
    read = frozen._read

    def counted(file, start: int, end: int) -> bytes:
        reads.append(end - start)
        return read(file, start, end)

    monkeypatch.setattr(frozen, "_read", counted)
    assert_ok(run_cli("convert", source, tmp_path / "streamed.pb", *flags))
    assert reads and max(reads) <= CHUNK < KERNEL_BYTES
    expected = _reference(source, tmp_path / "reference.pb", monkeypatch, *flags)
    assert (tmp_path / "streamed.pb").read_bytes() == expected
    written = graph_pb2.GraphDef.FromString(expected)
    kernels = [node for node in written.node if node.name in KERNELS]
    low = "--float32-weights" not in flags
    target = types_pb2.DT_BFLOAT16 if "bfloat16" in flags else types_pb2.DT_HALF
    assert [node.attr["value"].tensor.dtype for node in kernels] == [target if low else types_pb2.DT_FLOAT] * 3
    exp = next(node for node in written.node if node.name == "exp")
    assert exp.attr["T"].type == target  # c's values were read: exp of a non-positive argument is converted


def test_a_text_result_of_a_graph_read_with_its_values_left_holds_them(source: Path, tmp_path: Path) -> None:
    """Rule: a .pbtxt written from a graph whose values stayed in the file has them all."""
    model = savedmodel.read_model(source, constants_in_file=True)
    assert savedmodel.write_model(model, model.graph_def, tmp_path / "out.pbtxt")
    from google.protobuf import text_format

    written = text_format.Parse((tmp_path / "out.pbtxt").read_text(encoding="utf-8"), graph_pb2.GraphDef())
    assert written == _frozen_chain()


def test_a_file_cut_inside_a_large_constant_is_one_line_and_nothing_is_written(source: Path, tmp_path: Path) -> None:
    """Rule: a .pb cut short inside a constant left in the file is exit 2, one line naming the
    file and asking whether it is truncated; nothing is written."""
    content = savedmodel.read_model(source, constants_in_file=True).left_in_file.contents[KERNELS[1]]
    cut = tmp_path / "cut" / "frozen.pb"
    cut.parent.mkdir()
    cut.write_bytes(source.read_bytes()[:content.offset + content.length // 2])
    line = error_line(run_cli("convert", cut, tmp_path / "cut" / "out.pb", "--target", "bfloat16"))
    assert line.startswith(f"amp-rewrite: error: {cut}: not a valid GraphDef (")
    assert line.endswith("); is the file truncated?")
    assert listing(cut.parent) == {"frozen.pb"}


def test_a_source_cut_before_its_values_are_copied_is_one_line_and_nothing_is_written(
        source: Path, tmp_path: Path) -> None:
    """Rule: values that are no longer in the file when the result is written (something cut
    it meanwhile) are an error naming the file, never a short constant; nothing is written."""
    model = savedmodel.read_model(source, constants_in_file=True)
    source.write_bytes(source.read_bytes()[:model.left_in_file.contents[KERNELS[2]].offset + 10])
    (tmp_path / "out").mkdir()
    with pytest.raises(savedmodel.ModelError, match=f"^{re.escape(str(source))}: shorter than when it was read .*; nothing was"
                                                    " written: convert it again$"):
        savedmodel.write_model(model, model.graph_def, tmp_path / "out" / "result.pb")
    assert listing(tmp_path / "out") == set()
