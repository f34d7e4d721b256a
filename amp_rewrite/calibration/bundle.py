"""A checkpoint's files read and written a key at a time: TensorFlow's tensor bundle.

A bundle is ``PREFIX.index`` and its shards ``PREFIX.data-SSSSS-of-NNNNN``. The index is a
LevelDB table (TensorFlow writes it uncompressed since 1.2) from each key to its
``BundleEntryProto``: dtype, shape, the shard, the offset and size of its bytes there and
their crc32c; the key ``""`` holds the ``BundleHeaderProto`` (shard count, endianness).
TensorFlow's reader and ``SaveV2`` take or give whole tensors and write a shard per call,
and ``MergeV2Checkpoints`` keeps each call's shard; this module gives what they do not: each
key's place in the shards (to copy bytes as they are, keep the source's sharding, find a
shard missing or cut short before anything is written) and an index over shards written
piecewise. The bytes of every tensor stay TensorFlow's own (``cli/weights.py``). No TensorFlow
but its protos.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tensorflow.core.protobuf import tensor_bundle_pb2

MAGIC = 0xDB4775248B80FB57    # the last 8 bytes of a LevelDB table
FOOTER_BYTES = 48             # two block handles padded to 40 bytes, then the magic
BLOCK_BYTES = 4096            # data blocks are cut past this size, as LevelDB's default
UNCOMPRESSED = 0
HEADER_KEY = ""


class BundleError(ValueError):
    """A checkpoint's index that cannot be read as TensorFlow writes it."""


def data_path(prefix: Path, shard: int, shards: int) -> Path:
    return prefix.with_name(f"{prefix.name}.data-{shard:05d}-of-{shards:05d}")


def index_path(prefix: Path) -> Path:
    return prefix.with_name(f"{prefix.name}.index")


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC_TABLE = _crc_table()


def masked_crc32c(data: bytes) -> int:
    """LevelDB's masked crc32c of a block (blocks are a few kB: a table loop is enough)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(data):
            raise BundleError("a varint runs past the end of its block")
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position += 1
        if not byte & 0x80:
            return value, position
        shift += 7


def encode_varint(value: int) -> bytes:
    """Protobuf's and LevelDB's base-128 varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _block(data: bytes, offset: int, size: int) -> bytes:
    if offset + size + 5 > len(data):
        raise BundleError("a block runs past the end of the file")
    if data[offset + size] != UNCOMPRESSED:
        raise BundleError("a compressed block (written by TensorFlow 1.1 or older)")
    return data[offset:offset + size]


def _entries(block: bytes) -> list[tuple[bytes, bytes]]:
    """A block's (key, value) pairs; keys share a prefix with the one before."""
    if len(block) < 4:
        raise BundleError("a block too short for its restart count")
    restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 * (restarts + 1)
    found, key, position = [], b"", 0
    while position < end:
        shared, position = _varint(block, position)
        own, position = _varint(block, position)
        length, position = _varint(block, position)
        key = key[:shared] + block[position:position + own]
        position += own
        found.append((key, block[position:position + length]))
        position += length
    return found


def _handle(value: bytes) -> tuple[int, int]:
    offset, position = _varint(value, 0)
    size, _ = _varint(value, position)
    return offset, size


@dataclass(frozen=True)
class Index:
    """A bundle's header and every key's entry (a sliced tensor: its full entry and each slice's)."""

    header: tensor_bundle_pb2.BundleHeaderProto
    entries: dict[str, tensor_bundle_pb2.BundleEntryProto]


def read_index(prefix: Path) -> Index:
    """The index of the checkpoint at ``prefix``. Raises OSError, or BundleError naming what is wrong."""
    data = index_path(prefix).read_bytes()
    if len(data) < FOOTER_BYTES or struct.unpack_from("<Q", data, len(data) - 8)[0] != MAGIC:
        raise BundleError("not a checkpoint index (no table footer); is the file truncated?")
    footer = data[len(data) - FOOTER_BYTES:]
    _, position = _varint(footer, _varint(footer, 0)[1])  # the metaindex handle: unused
    index_offset, position = _varint(footer, position)
    index_size, _ = _varint(footer, position)
    header, entries = None, {}
    for _, handle in _entries(_block(data, index_offset, index_size)):
        for key, value in _entries(_block(data, *_handle(handle))):
            name = key.decode("utf-8", "surrogateescape")
            if name == HEADER_KEY:
                header = tensor_bundle_pb2.BundleHeaderProto.FromString(value)
            else:
                entries[name] = tensor_bundle_pb2.BundleEntryProto.FromString(value)
    if header is None:
        raise BundleError("the index has no header entry")
    return Index(header, entries)


class _TableWriter:
    """A LevelDB table, as TensorFlow's ``TableBuilder`` writes it (every key a restart point)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.index: list[tuple[bytes, bytes]] = []
        self.block: list[tuple[bytes, bytes]] = []
        self.block_size = 0

    def add(self, key: bytes, value: bytes) -> None:
        self.block.append((key, value))
        self.block_size += len(key) + len(value) + 8
        if self.block_size >= BLOCK_BYTES:
            self._flush()

    def _write_block(self, pairs: list[tuple[bytes, bytes]]) -> bytes:
        body, restarts = bytearray(), []
        for key, value in pairs:
            restarts.append(len(body))
            body += encode_varint(0) + encode_varint(len(key)) + encode_varint(len(value)) + key + value
        restarts = restarts or [0]
        body += struct.pack(f"<{len(restarts)}I", *restarts) + struct.pack("<I", len(restarts))
        handle = encode_varint(len(self.out)) + encode_varint(len(body))
        self.out += body + bytes([UNCOMPRESSED]) + struct.pack("<I", masked_crc32c(bytes(body) + b"\0"))
        return handle

    def _flush(self) -> None:
        if self.block:
            self.index.append((self.block[-1][0], self._write_block(self.block)))
            self.block, self.block_size = [], 0

    def finish(self) -> bytes:
        self._flush()
        metaindex = self._write_block([])
        index = self._write_block(self.index)
        footer = (metaindex + index).ljust(FOOTER_BYTES - 8, b"\0") + struct.pack("<Q", MAGIC)
        return bytes(self.out + footer)


def index_bytes(index: Index) -> bytes:
    """``index`` as TensorFlow writes a ``.index`` file: the header, then the keys in byte order."""
    table = _TableWriter()
    table.add(b"", index.header.SerializeToString(deterministic=True))
    for key in sorted(index.entries, key=lambda name: name.encode("utf-8", "surrogateescape")):
        table.add(key.encode("utf-8", "surrogateescape"), index.entries[key].SerializeToString(deterministic=True))
    return table.finish()


Extents = tuple[tuple[int, int], ...]  # (start, length) on each axis, in the whole tensor


def _num_increasing(value: int) -> bytes:
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return bytes([len(raw)]) + raw


def _signed_increasing(value: int) -> bytes:
    """OrderedCode's signed numbers: n bytes, the first with n leading ones then a zero; a
    negative number is its complement's bytes inverted."""
    if value < 0:
        return bytes(~byte & 0xFF for byte in _signed_increasing(~value))
    size = next(n for n in range(1, 8) if value < 1 << (7 * n - 1))
    return (value | ((1 << size) - 1) << (7 * size)).to_bytes(size, "big")


def slice_key(name: str, extents: Iterable[tuple[int, int]]) -> str:
    """The key TensorFlow stores one slice of tensor ``name`` under (``EncodeTensorNameSlice``);
    a length of -1 is the whole axis."""
    extents = tuple(extents)
    escaped = b"".join(b"\0\xff" if byte == 0 else b"\xff\0" if byte == 0xFF else bytes([byte])
                       for byte in name.encode("utf-8"))
    out = b"\0" + escaped + b"\0\1" + _num_increasing(len(extents))
    out += b"".join(_signed_increasing(start) + _signed_increasing(length) for start, length in extents)
    return out.decode("utf-8", "surrogateescape")


def parts(index: Index, key: str) -> list[tuple[str, tensor_bundle_pb2.BundleEntryProto, Extents]]:
    """Where a tensor's bytes are: its own entry, or one entry per stored slice; each with the
    part of the tensor it holds. Raises BundleError when a slice's entry is missing."""
    entry = index.entries[key]
    dims = [dim.size for dim in entry.shape.dim]
    if not entry.slices:
        return [(key, entry, tuple((0, size) for size in dims))]
    found = []
    for stored in entry.slices:
        given = [(extent.start, extent.length if extent.HasField("length") else -1) for extent in stored.extent]
        name = slice_key(key, given)
        if name not in index.entries:
            raise BundleError(f"key '{key}' names a slice the index does not hold")
        found.append((name, index.entries[name], tuple((start, size if length < 0 else length) for
                                                       (start, length), size in zip(given, dims))))
    return found
