"""Beyond grappler: a loop-invariant weight's cast runs once before the loop, not every iteration.

A weight read inside a loop body through a cast to the target casts the whole weight on
every iteration. Where the weight stays float32 (another reader reads it so: a tied
embedding's lookup, while the loop's logits read it transposed through a cast), a decode
loop pays that cast for every generated token. When the body only reads the variable
(its handle is passed through the loop unchanged and nothing in the body writes it), the
value cannot change between iterations: the read and the cast move to the loop's caller,
and the cast value enters the loop as one more loop value, passed through unchanged.
Only with linked loop boundaries (``cross_function``), whose loops may change signature.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2, tensor_shape_pb2, types_pb2

from amp_rewrite.core.casts import is_amp_cast
from amp_rewrite.core.functions import LOOP_OPS, called_functions
from amp_rewrite.core.graph_io import copy_graph_def, make_node_def

_UNKNOWN = tensor_shape_pb2.TensorShapeProto(unknown_rank=True)


def hoist_invariant_casts(graph_def: graph_pb2.GraphDef, private: frozenset[str]) -> graph_pb2.GraphDef:
    """``graph_def`` with each loop's casts of read-only weights moved before the loop;
    ``private``: the functions whose signatures may change (a body and its cond must be)."""
    output = copy_graph_def(graph_def)
    library = {f.signature.name: f for f in output.library.function}
    call_sites = Counter(name for f in [None, *library.values()]
                         for node in (output.node if f is None else f.node_def) for name in called_functions(node))
    items: list[tuple[function_pb2.FunctionDef | None, object]] = [(None, output.node)]
    items += [(f, f.node_def) for f in library.values()]
    for function, nodes in items:
        for node in [n for n in nodes if n.op in LOOP_OPS]:
            body, cond = library[node.attr["body"].func.name], library[node.attr["cond"].func.name]
            if {body.signature.name, cond.signature.name} <= private and call_sites[body.signature.name] == 1 \
                    and call_sites[cond.signature.name] == 1:
                for index, cast in _invariant_casts(body):
                    _hoist(node, nodes, function is not None, index, cast, body=body, cond=cond)
    return output


def _invariant_casts(body: function_pb2.FunctionDef) -> list[tuple[int, node_def_pb2.NodeDef]]:
    """(loop value index, cast) for each AMP cast of a ReadVariableOp of a resource the body
    passes through unchanged and only reads."""
    args = body.signature.input_arg
    nodes = {node.name: node for node in body.node_def}
    found = []
    for index, arg in enumerate(args):
        if arg.type != types_pb2.DT_RESOURCE or body.ret[body.signature.output_arg[index].name] != arg.name:
            continue
        readers = [node for node in body.node_def if arg.name in node.input]
        if any(node.op != "ReadVariableOp" for node in readers):
            continue  # written, gathered or handed on: not a plain read
        reads = {f"{node.name}:value:0" for node in readers}
        found += [(index, node) for node in nodes.values() if is_amp_cast(node) and node.input[0] in reads]
    return found


def _hoist(loop: node_def_pb2.NodeDef, nodes, in_function: bool, index: int, cast: node_def_pb2.NodeDef, *,
           body: function_pb2.FunctionDef, cond: function_pb2.FunctionDef) -> None:
    """The read and ``cast`` before ``loop`` (in its caller's ``nodes``), fed in as a new loop value."""
    dtype = cast.attr["DstT"].type
    data = [tensor for tensor in loop.input if not tensor.startswith("^")]
    control = [tensor for tensor in loop.input if tensor.startswith("^")]
    name = f"{loop.name}/hoisted/{cast.name}"
    # The read waits for what the loop waits for (automatic control dependencies order a
    # write of the variable before the loop so).
    read = make_node_def("ReadVariableOp", f"{name}/read", [data[index], *control], device=loop.device, into=nodes,
                         dtype=types_pb2.DT_FLOAT)
    make_node_def("Cast", name, [f"{read.name}:value:0" if in_function else read.name], device=loop.device,
                  into=nodes, SrcT=types_pb2.DT_FLOAT, DstT=dtype, Truncate=False)
    loop.input[:] = [*data, f"{name}:y:0" if in_function else name, *control]
    loop.attr["T"].list.type.append(dtype)
    for attr in ("output_shapes", "_output_shapes"):
        if attr in loop.attr:
            loop.attr[attr].list.shape.append(_UNKNOWN)
    if "_num_original_outputs" in loop.attr:
        loop.attr["_num_original_outputs"].i = len(loop.attr["T"].list.type)
    taken = {a.name for f in (body, cond) for a in f.signature.input_arg} | {n.name for f in (body, cond)
                                                                             for n in f.node_def}
    arg = next(f"hoisted_{count}" for count in range(len(taken) + 1) if f"hoisted_{count}" not in taken)
    for function in (body, cond):
        function.signature.input_arg.add(name=arg, type=dtype)
        if "_input_shapes" in function.attr:
            function.attr["_input_shapes"].list.shape.append(_UNKNOWN)
    body.signature.output_arg.add(name=f"{arg}_out", type=dtype)
    body.ret[f"{arg}_out"] = arg
    _replace_input(body, f"{cast.name}:y:0", arg)
    body.node_def.remove(cast)


def _replace_input(function: function_pb2.FunctionDef, old: str, new: str) -> None:
    for node in function.node_def:
        if old in node.input:
            node.input[:] = [new if tensor == old else tensor for tensor in node.input]
    ret: Mapping[str, str] = dict(function.ret)
    for key, value in ret.items():
        if value == old:
            function.ret[key] = new
