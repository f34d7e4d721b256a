"""The precisions a graph can be rewritten to, each one frozen value holding every fact about it,
and the float dtypes' names and sizes (``FLOAT_DTYPES``).

A user names a target with a string (``"float16"``); ``lookup_target`` turns it into its
``Target`` once, at the edge, and raises the one error for a name that is not a target.
Everything below receives the value, never the string again.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tensorflow.core.framework import types_pb2

from amp_rewrite.errors import AmpRewriteError


@dataclass(frozen=True)
class FloatDtype:
    """A float dtype a weight is stored in: the name users know, and its size."""

    name: str        # as Python and reports name it, e.g. "bfloat16"
    item_bytes: int  # bytes per value


# float32 and the dtypes a rewrite stores a float32 weight as, by DataType enum: the one table.
FLOAT_DTYPES: Mapping[int, FloatDtype] = MappingProxyType({
    types_pb2.DT_FLOAT: FloatDtype("float32", 4),
    types_pb2.DT_HALF: FloatDtype("float16", 2),
    types_pb2.DT_BFLOAT16: FloatDtype("bfloat16", 2),
})


@dataclass(frozen=True)
class Target:
    """One low precision: what it is called, what dtype it is, where it runs and what it is measured against."""

    name: str                # what users write and reports show, e.g. "float16"
    dtype: int               # the DataType enum painted vertices get, e.g. DT_HALF
    device_type: str         # the device type whose kernels it converts on (spec §1.5)
    cast_kind: str           # the <Kind> of a float32 → target cast's name (spec §2.6)
    tolerance: float         # largest error of an output, relative to its float32 magnitude, accepted
    grappler_optimizer: str  # the grappler optimizer that does the same rewrite: our reference (spec §8)
    colouring: str           # the target whose lists, colouring and casts it uses: itself, or float16 for float8


# float16: NVIDIA GPUs, 11 mantissa bits; bfloat16: CPUs with oneDNN, 8 mantissa bits.
FLOAT16 = Target("float16", types_pb2.DT_HALF, "GPU", "CastToFp16", 1e-2, "auto_mixed_precision", "float16")
BFLOAT16 = Target("bfloat16", types_pb2.DT_BFLOAT16, "CPU", "CastToBf16", 5e-2, "auto_mixed_precision_onednn_bfloat16",
                  "bfloat16")
# float8: the float16 rewrite, then the matmuls it converted take float8_e4m3fn operands with
# per-tensor scales (core/float8/inference.py). Everything it paints is float16, so dtype, device, casts
# and grappler reference are float16's. Tolerance: E4M3 keeps 3 mantissa bits, so one rounding
# moves a value by up to 2**-4 = 6.25%; the worst output error measured under XLA on 20 held-out
# batches each of the built-in MLP, CNN and Transformer encoder was 7.2e-2 (median 3-6e-2;
# float16: 1.3e-3), so 1e-1 (README, "The float8 target").
FLOAT8 = Target("float8", types_pb2.DT_HALF, "GPU", "CastToFp16", 1e-1, "auto_mixed_precision", "float16")
# The colouring targets: each has its own lists and a grappler pass to compare with.
NAME_TO_TARGET: Mapping[str, Target] = MappingProxyType({target.name: target for target in (FLOAT16, BFLOAT16)})
TARGETS: tuple[str, ...] = tuple(NAME_TO_TARGET)
# The low precisions a model computes or stores in: the colouring targets' dtypes (float16, bfloat16).
LOW_DTYPES = frozenset(target.dtype for target in NAME_TO_TARGET.values())
# Targets built on a colouring target's rewrite: rewrite_graph_def, load_lists (the colouring
# target's lists) and the CLI take them, with lookup_target(name, quantized=True).
NAME_TO_QUANTIZED_TARGET: Mapping[str, Target] = MappingProxyType({FLOAT8.name: FLOAT8})
# Not a Target: nothing is converted to it. A model already mixed goes back to float32
# (core/canonical.py); rewrite_graph_def and convert --target take the name.
FLOAT32_NAME = "float32"


def lookup_target(name: str | Target, *, quantized: bool = False) -> Target:
    """The target called ``name`` (a ``Target`` is returned as it is); the one place an
    unknown target is refused. ``quantized``: the caller takes float8 too."""
    if isinstance(name, Target):
        return name
    names = {**NAME_TO_TARGET, **NAME_TO_QUANTIZED_TARGET} if quantized else NAME_TO_TARGET
    target = names.get(name) if isinstance(name, str) else None
    if target is None and name == FLOAT32_NAME:
        raise AmpRewriteError(f"target {name!r} converts nothing to low precision, so it has no lists or casts: use"
                              " amp_rewrite.to_float32 (convert --target float32) to take a mixed model back to it")
    if target is None:
        raise AmpRewriteError(f"unknown target {name!r}; use one of {', '.join(names)}")
    return target
