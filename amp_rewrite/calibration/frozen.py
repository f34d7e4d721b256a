"""A binary GraphDef file read and written a node at a time, its large constants left in the file.

A frozen graph's weights are ``Const`` nodes, and nearly all of its bytes are their
``tensor_content``. The rewrite needs a Const's dtype and shape, not its values (but for
the few colouring reads, ``colouring.constants_read``), so the reader can leave a large
one's bytes in the file (``LeftInFile``: node -> byte range) and hold the node with
``graph_io.LEFT_IN_FILE`` in their place, which no valid tensor holds (so reading it fails
loudly, never as zeros); the writer copies them from there, rounded to float16/bfloat16
where the weights step stored the node low (``weights._put_rounded`` gives it that dtype
and keeps the mark), a chunk at a time. The process never holds the weights.

Reading and writing follow protobuf's wire format (fields are tag, then a varint length
and the payload for messages and bytes): nodes (``GraphDef`` field 1) are parsed one at a
time, the other fields (library, versions) together at the end, as protobuf merges them;
the file written is the deterministic serialization an in-memory GraphDef gives (fields in
number order, map keys sorted), with the left values spliced in where they belong.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator, Mapping

import numpy as np
from google.protobuf import message
from tensorflow.core.framework import graph_pb2, node_def_pb2, tensor_pb2, types_pb2

from amp_rewrite.calibration.bundle import encode_varint
from amp_rewrite.core.graph_io import LEFT_IN_FILE, copy_graph_def, is_left_in_file
from amp_rewrite.core.target import FLOAT_DTYPES, LOW_DTYPES  # LOW_DTYPES: what a float32 weight may be stored as
from amp_rewrite.core.weights import round_to, without_nodes
from amp_rewrite.errors import ModelError

LARGE_BYTES = 1 << 20         # a Const's tensor_content this large is left in the file
CHUNK_BYTES = 1 << 22         # values copied (and rounded) at a time
NODE, ATTR, TENSOR, CONTENT = 1, 5, 8, 4  # GraphDef.node, NodeDef.attr, AttrValue.tensor, TensorProto.tensor_content
LENGTH = 2                    # the wire type of messages and bytes


@dataclass(frozen=True)
class Content:
    """Where a Const's ``tensor_content`` lies in the source file, and the dtype it holds."""

    offset: int
    length: int
    dtype: int


@dataclass(frozen=True)
class LeftInFile:
    """The values a read left in ``path``: Const node name -> its ``tensor_content``."""

    path: Path
    contents: Mapping[str, Content] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(content.length for content in self.contents.values())


# --------------------------------------------------------------------------------------
# Reading


def read_graph_def(path: Path, large: int | None = LARGE_BYTES) -> tuple[graph_pb2.GraphDef, LeftInFile]:
    """``path`` parsed a node at a time; a main-graph Const's ``value`` whose tensor_content is
    ``large`` bytes or more keeps those bytes in the file (None: every byte is read).
    A file that protobuf cannot parse raises ``message.DecodeError``."""
    graph_def, contents, rest = graph_pb2.GraphDef(), {}, bytearray()
    with open(path, "rb") as file:
        for number, wire, start, payload, end in _fields(file, 0, os.fstat(file.fileno()).st_size):
            if number != NODE or wire != LENGTH:
                rest += _read(file, start, end)
            elif large is None or end - payload < large:
                graph_def.node.add().MergeFromString(_read(file, payload, end))
            else:
                content = _read_node(file, payload, end, large, graph_def.node.add())
                if content is not None:
                    contents[graph_def.node[-1].name] = content
    graph_def.MergeFromString(bytes(rest))
    return graph_def, LeftInFile(Path(path), contents)


def _varint(file: BinaryIO) -> int:
    value, shift = 0, 0
    while byte := file.read(1):
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7
    raise message.DecodeError("the file ends inside a varint")


def _fields(file: BinaryIO, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(number, wire type, field start, payload start, field end) of each field of the message
    in bytes [start, end) of ``file``, reading tags and lengths only."""
    at = start
    while at < end:
        file.seek(at)
        tag = _varint(file)
        wire, payload = tag & 7, file.tell()
        if wire == 0:
            _varint(file)
            stop = file.tell()
        elif wire in (1, 5):
            stop = payload + (8 if wire == 1 else 4)
        elif wire == LENGTH:
            length = _varint(file)
            payload = file.tell()
            stop = payload + length
        else:
            raise message.DecodeError(f"unsupported wire type {wire}")
        if stop > end:
            where = "the file ends" if start == 0 else "its message ends"
            raise message.DecodeError(f"{where} inside a field of {stop - payload} bytes")
        yield tag >> 3, wire, at, payload, stop
        at = stop


def _read(file: BinaryIO, start: int, end: int) -> bytes:
    file.seek(start)
    return file.read(end - start)


def _read_node(file: BinaryIO, start: int, end: int, large: int, node: node_def_pb2.NodeDef) -> Content | None:
    """The NodeDef in bytes [start, end) into ``node``: a Const's large ``value`` without its
    tensor_content, whose place it returns (None: every byte read, as for any other node)."""
    kept, skimmed = bytearray(), None
    for number, wire, field_start, payload, stop in _fields(file, start, end):
        if skimmed is None and number == ATTR and wire == LENGTH and stop - payload >= large:
            skimmed = _skim_attr(file, payload, stop, large)
            if skimmed is not None:
                continue
        kept += _read(file, field_start, stop)
    node.MergeFromString(bytes(kept))
    if skimmed is None:
        return None
    key, tensor, content = skimmed
    if node.op != "Const" or key != "value" or key in node.attr:  # not a weight, or the attr given twice
        node.Clear()
        node.MergeFromString(_read(file, start, end))
        return None
    node.attr[key].tensor.MergeFromString(tensor)
    node.attr[key].tensor.tensor_content = LEFT_IN_FILE
    return Content(content.offset, content.length, node.attr[key].tensor.dtype)


def _skim_attr(file: BinaryIO, start: int, end: int, large: int) -> tuple[str, bytes, Content] | None:
    """A NodeDef.attr entry in bytes [start, end) that holds a tensor with a ``large``
    tensor_content: (key, the TensorProto's other fields, the content's place); else None."""
    parts = {}
    for number, wire, _, payload, stop in _fields(file, start, end):
        if wire != LENGTH or number not in (1, 2) or number in parts:
            return None
        parts[number] = (payload, stop)
    if set(parts) != {1, 2}:
        return None
    tensor = None
    for number, wire, _, payload, stop in _fields(file, *parts[2]):  # the AttrValue: a tensor only
        if number != TENSOR or wire != LENGTH or tensor is not None:
            return None
        tensor = (payload, stop)
    if tensor is None:
        return None
    meta, content = bytearray(), None
    for number, wire, field_start, payload, stop in _fields(file, *tensor):
        if number == CONTENT and wire == LENGTH and content is None and stop - payload >= large:
            content = Content(payload, stop - payload, types_pb2.DT_INVALID)
        else:
            meta += _read(file, field_start, stop)
    try:
        key = _read(file, *parts[1]).decode("utf-8")
    except UnicodeDecodeError:
        return None  # protobuf's own parse says what is wrong
    return (key, bytes(meta), content) if content is not None else None


def hold(graph_def: graph_pb2.GraphDef, left: LeftInFile, names: frozenset[str]) -> LeftInFile:
    """The Consts ``names`` of ``graph_def`` read from the file into their nodes; what stays left."""
    held = names & set(left.contents)
    if not held:
        return left
    with open(left.path, "rb") as file:
        for node in graph_def.node:
            if node.name in held:
                content = left.contents[node.name]
                node.attr["value"].tensor.tensor_content = _read(file, content.offset, content.offset + content.length)
    return LeftInFile(left.path, {name: c for name, c in left.contents.items() if name not in held})


# --------------------------------------------------------------------------------------
# Writing


def write_graph_def(path: Path, graph_def: graph_pb2.GraphDef, left: LeftInFile | None = None) -> None:
    """``graph_def``'s deterministic serialization written to ``path`` a node at a time, each
    Const whose values ``left`` holds filled from its file (rounded where it is low now)."""
    with open(path, "wb") as out, contextlib.ExitStack() as stack:
        source = stack.enter_context(open(left.path, "rb")) if left is not None and left.contents else None
        for node in graph_def.node:
            content = _left_content(node, left)
            if content is None or not _write_filled(out, node, content, source):
                data = (node if content is None else _filled(node, content, source)).SerializeToString(
                    deterministic=True)
                out.write(_header(NODE, len(data)) + data)
        out.write(without_nodes(graph_def).SerializeToString(deterministic=True))


def loaded(graph_def: graph_pb2.GraphDef, left: LeftInFile | None) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` with every value ``left`` holds in its node (to run or print it)."""
    copy = copy_graph_def(graph_def)
    if left is not None and left.contents:
        with open(left.path, "rb") as source:
            for node in copy.node:
                content = _left_content(node, left)
                if content is not None:
                    node.CopyFrom(_filled(node, content, source))
    return copy


def _left_content(node: node_def_pb2.NodeDef, left: LeftInFile | None) -> Content | None:
    """The values of ``node`` left in the file, if it still holds none of its own."""
    content = left.contents.get(node.name) if left is not None else None
    if content is None or node.op != "Const" or not is_left_in_file(node.attr["value"].tensor):
        return None
    dtype = node.attr["value"].tensor.dtype
    if dtype != content.dtype and not (content.dtype == types_pb2.DT_FLOAT and dtype in LOW_DTYPES):
        raise ValueError(f"Const '{node.name}' left in {left.path} holds {content.dtype} and is {dtype} now")
    return content


def _values(source: BinaryIO, content: Content, dtype: int) -> Iterator[bytes]:
    """The bytes of ``content`` a chunk at a time, rounded from float32 where ``dtype`` differs."""
    step = CHUNK_BYTES - CHUNK_BYTES % 4
    for at in range(content.offset, content.offset + content.length, step):
        chunk = _read(source, at, min(at + step, content.offset + content.length))
        if len(chunk) < min(step, content.offset + content.length - at):
            raise ModelError(f"{source.name}: shorter than when it was read (something wrote to it during the"
                             " conversion); nothing was written: convert it again")
        if dtype == content.dtype:
            yield chunk
        else:
            yield round_to(np.frombuffer(chunk, np.float32), dtype).tobytes()


def _length(content: Content, dtype: int) -> int:
    if dtype == content.dtype:
        return content.length
    return content.length // FLOAT_DTYPES[content.dtype].item_bytes * FLOAT_DTYPES[dtype].item_bytes


def _filled(node: node_def_pb2.NodeDef, content: Content, source: BinaryIO) -> node_def_pb2.NodeDef:
    copy = node_def_pb2.NodeDef()
    copy.CopyFrom(node)
    tensor = copy.attr["value"].tensor
    tensor.tensor_content = b"".join(_values(source, content, tensor.dtype))
    return copy


def _header(number: int, length: int) -> bytes:
    return encode_varint(number << 3 | LENGTH) + encode_varint(length)


def _write_filled(out: BinaryIO, node: node_def_pb2.NodeDef, content: Content, source: BinaryIO) -> bool:
    """``node`` written as its deterministic serialization with ``content``'s values, streamed;
    False (nothing written) when its parts do not add up to it (fields this protobuf does not know)."""
    tensor = node.attr["value"].tensor
    head, tail = _split(node, "value")
    tensor_head, tensor_tail = _split_tensor(tensor)
    alone = node_def_pb2.NodeDef()
    alone.attr["value"].CopyFrom(node.attr["value"])
    mark = len(_header(CONTENT, len(LEFT_IN_FILE))) + len(LEFT_IN_FILE)
    if (len(head) + len(alone.SerializeToString(deterministic=True)) + len(tail) != node.ByteSize()
            or len(tensor_head) + mark + len(tensor_tail) != tensor.ByteSize()):
        return False
    length = _length(content, tensor.dtype)
    tensor_bytes = len(tensor_head) + len(_header(CONTENT, length)) + length + len(tensor_tail)
    attr_bytes = len(_header(TENSOR, tensor_bytes)) + tensor_bytes
    key = _header(1, len(b"value")) + b"value"
    entry_bytes = len(key) + len(_header(2, attr_bytes)) + attr_bytes
    node_bytes = len(head) + len(_header(ATTR, entry_bytes)) + entry_bytes + len(tail)
    out.write(_header(NODE, node_bytes) + head + _header(ATTR, entry_bytes) + key + _header(2, attr_bytes)
              + _header(TENSOR, tensor_bytes) + tensor_head + _header(CONTENT, length))
    for chunk in _values(source, content, tensor.dtype):
        out.write(chunk)
    out.write(tensor_tail + tail)
    return True


def _split(node: node_def_pb2.NodeDef, key: str) -> tuple[bytes, bytes]:
    """``node``'s deterministic bytes before and after its attr entry ``key`` (fields in
    number order, attr entries sorted by key)."""
    head, tail = node_def_pb2.NodeDef(), node_def_pb2.NodeDef()
    for described, value in node.ListFields():
        if described.number == ATTR:
            for name, attr in value.items():
                if name != key:
                    (head if name < key else tail).attr[name].CopyFrom(attr)
        else:
            _put(head if described.number < ATTR else tail, described, value)
    return head.SerializeToString(deterministic=True), tail.SerializeToString(deterministic=True)


def _split_tensor(tensor: tensor_pb2.TensorProto) -> tuple[bytes, bytes]:
    """``tensor``'s deterministic bytes before and after the place of its tensor_content."""
    head, tail = tensor_pb2.TensorProto(), tensor_pb2.TensorProto()
    for described, value in tensor.ListFields():
        if described.number != CONTENT:
            _put(head if described.number < CONTENT else tail, described, value)
    return head.SerializeToString(deterministic=True), tail.SerializeToString(deterministic=True)


def _put(holder: message.Message, described, value) -> None:
    repeated = getattr(described, "is_repeated", None)  # newer protobuf (6.x); before it (4.25, 5.29) only the label says
    if repeated is None:
        repeated = described.label == described.LABEL_REPEATED
    if repeated:
        getattr(holder, described.name).extend(value)
    elif described.message_type is not None:
        getattr(holder, described.name).CopyFrom(value)
    else:
        setattr(holder, described.name, value)
