"""What precision a model already computes in, read from its graph before any rewrite: the
line ``inspect`` and the report open with, and the allow-list nodes already low that a
rewrite would leave as they are.

Users arrive with models already mixed — a Keras ``mixed_float16`` export, an earlier output
of ours — as well as float32 ones, and what can be done with them (retargeted exactly, or
only with rounding) depends on what the graph computes in and what its variables store.
"""
from __future__ import annotations

import collections
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from amp_rewrite.core import casts
from amp_rewrite.core.functions import reachable_functions
from amp_rewrite.core.graph_io import data_inputs, every_node, input_node
from amp_rewrite.core.lists import OpLists
from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.report import dtype_name
from amp_rewrite.core.target import LOW_DTYPES

# Ops whose low dtype says where values go or how they are kept, not what computes: a cast
# (Keras' mixed policies cast every input and weight), constants and arguments, identities,
# calls (their bodies are counted), variables and checkpoint I/O, and the ops that only move,
# reshape or measure values (Keras 3 and tf_keras place these differently around the same layers).
NOT_COMPUTE = frozenset({
    "Cast", "Const", "Placeholder", "PlaceholderWithDefault", "_Arg", "_Retval", "Identity", "IdentityN",
    "NoOp", "StatefulPartitionedCall", "PartitionedCall", "ReadVariableOp", "VarHandleOp", "AssignVariableOp",
    "VariableV2", "Variable", "RestoreV2", "SaveV2", "StopGradient",
    "Reshape", "Squeeze", "ExpandDims", "Shape", "ShapeN", "Size", "Rank", "Transpose", "Pack", "Unpack",
    "ConcatV2", "Slice", "StridedSlice", "Split", "SplitV", "Tile", "ZerosLike", "OnesLike",
})
# Ops that hold a variable in the graph (TF1 reference variables), read by Identity rather than ReadVariableOp.
REF_VARIABLE_OPS = frozenset({"VariableV2", "Variable"})


def already_low(graph_def: graph_pb2.GraphDef, lists: OpLists) -> dict[str, list[str]]:
    """The allow-list nodes (matmuls, convolutions: what a rewrite converts first) that compute
    in float16 or bfloat16 already, by dtype name: a model converted before, or built under a
    Keras mixed policy. The rewrite paints float32 only, so it leaves them as they are."""
    found = collections.defaultdict(list)
    for node in every_node(graph_def):
        dtypes = ({dtype_name(value.type) for value in node.attr.values() if value.type in LOW_DTYPES}
                  if node.op in lists.allow else ())
        for dtype in dtypes:
            found[dtype].append(node.name)
    return dict(found)


@dataclass(frozen=True)
class SourcePrecision:
    """What a model computes in and stores, counted over the items that run."""

    compute: Mapping[str, int]    # low dtype name -> nodes computing in it
    variables: Mapping[str, int]  # dtype name -> variable reads (TF1: variables) in it
    master_casts: int             # float32 variable reads cast to a low dtype at once: Keras' mixed policies
    rewrite_casts: int            # casts named as grappler's pass (and ours) names them

    @property
    def origin(self) -> str:
        """A guess at where the model comes from, from its casts and variables; "" if none fits."""
        if not self.compute:
            return ""
        low = "/".join(sorted(self.compute))
        if self.rewrite_casts:
            return f"an amp_rewrite (or grappler) {low} rewrite"
        if self.master_casts and set(self.variables) == {"float32"}:
            return f"a Keras mixed_{low} export?"
        return ""

    def line(self) -> str:
        """One line for people: "Source: computes 37 nodes in float16, variables float32: a Keras
        mixed_float16 export?", or "Source: float32 ..." where nothing computes low."""
        if not self.compute:
            return "Source: float32 (no node computes in float16 or bfloat16)"
        counts = sorted(self.compute.items(), key=lambda item: (-item[1], item[0]))
        text = f"Source: computes {counts[0][1]} nodes in {counts[0][0]}"
        text += "".join(f" and {count} in {dtype}" for dtype, count in counts[1:])
        if self.variables:
            text += ", variables " + " and ".join(sorted(self.variables))
        return f"{text}: {self.origin}" if self.origin else text


def source_precision(graph_def: graph_pb2.GraphDef, *, skip: Collection[str] = ()) -> SourcePrecision:
    """What ``graph_def`` computes in: its main graph and the library functions that run
    (``reachable_functions``), less the items named in ``skip`` (TensorFlow's plumbing: a
    SavedModel's loader graph, MAIN_GRAPH, and its save/restore functions)."""
    library = {function.signature.name: function for function in graph_def.library.function}
    items = [] if MAIN_GRAPH in skip else [list(graph_def.node)]
    items += [list(library[name].node_def) for name in reachable_functions(graph_def, library) if name not in skip]
    compute: collections.Counter[str] = collections.Counter()
    variables: collections.Counter[str] = collections.Counter()
    master_casts = rewrite_casts = 0
    for nodes in items:
        name_to_node = {node.name: node for node in nodes}
        for node in nodes:
            low = {value.type for value in node.attr.values() if value.type in LOW_DTYPES}
            if node.op not in NOT_COMPUTE and low:
                compute.update(dtype_name(dtype) for dtype in low)
            if node.op == "ReadVariableOp" or node.op in REF_VARIABLE_OPS:
                variables[dtype_name(node.attr["dtype"].type)] += 1
            if node.op == "Cast" and node.attr["DstT"].type in LOW_DTYPES:
                rewrite_casts += casts.CAST_NAME.match(node.name) is not None
                master_casts += _reads_float32_variable(node, name_to_node)
    return SourcePrecision(dict(compute), dict(variables), master_casts, rewrite_casts)


def _reads_float32_variable(cast: node_def_pb2.NodeDef, name_to_node: Mapping[str, node_def_pb2.NodeDef]) -> bool:
    """Whether ``cast`` reads a float32 variable directly (ReadVariableOp, or a TF1 variable's Identity)."""
    inputs = data_inputs(cast)
    source = name_to_node.get(input_node(inputs[0])) if inputs else None
    if source is not None and source.op == "Identity" and data_inputs(source):
        variable = name_to_node.get(input_node(data_inputs(source)[0]))
        source = variable if variable is not None and variable.op in REF_VARIABLE_OPS else source
    return (source is not None and (source.op == "ReadVariableOp" or source.op in REF_VARIABLE_OPS)
            and source.attr["dtype"].type == types_pb2.DT_FLOAT)
