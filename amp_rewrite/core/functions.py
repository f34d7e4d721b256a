"""Function bodies as GraphDefs and back, and which library functions grappler rewrites.

Grappler's meta-optimizer rewrites each reachable function body as its own item
(spec §1.2): the body becomes a graph whose inputs are ``_Arg`` nodes and whose outputs
are ``_Retval`` nodes, with FunctionDef's ``node:output_arg:index`` input names turned
into ``node:port``. After painting, the body goes back into a FunctionDef with the same
signature, so every caller stays valid.
"""
from __future__ import annotations

import functools
import itertools
import re
from typing import Container, Iterable, Iterator, Mapping, Sequence

from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2, node_def_pb2, op_def_pb2

from amp_rewrite.core import support
from amp_rewrite.core.graph_io import CONTROL, arg_port_count, make_node_def, parse_tensor_name
from amp_rewrite.errors import GraphError

RETVAL_SUFFIX = "_RetVal"
LOOP_OPS = frozenset({"While", "StatelessWhile"})  # functional loops: a body and a cond function
# A traced tf.function's name: TensorFlow's prefix, the Python name, then a process-wide
# counter (two for a backward function), which a new process or another export changes.
_TRACED_NAME = re.compile(r"(__inference_|__forward_|__backward_)(.+?)((?:_\d+){1,2})")


@functools.lru_cache(maxsize=None)
def stable_name(function: str) -> str:
    """The name a traced function keeps across processes and exports: without TensorFlow's
    counter (``__inference___call___23578`` → ``__inference___call__``); other names as they are."""
    found = _TRACED_NAME.fullmatch(function)
    if found is None:
        return function
    prefix, name, counters = found.groups()
    kept = counters.count("_") - (2 if prefix == "__backward_" else 1)
    return prefix + name + "".join(f"_{part}" for part in counters.split("_")[1:][:kept])


# FUNCTION::NAME: a node, tensor or pattern inside library function FUNCTION (an overlay's
# keep_nodes, amax and lossy keys); NAME alone is one in any item, or in the main graph.
SCOPE = "::"


def scoped_name(function: str, name: str) -> str:
    """``FUNCTION::name``, or ``name`` alone for the main graph (``function`` "", ``MAIN_GRAPH``)."""
    return f"{function}{SCOPE}{name}" if function else name


def split_scope(text: str) -> tuple[str | None, str]:
    """``scoped_name``'s inverse: (FUNCTION, NAME) of ``FUNCTION::NAME``, (None, ``text``)
    without ``::``. Split at the first ``::``: a function's name holds no ``:``, a NAME may (a
    regex); either part may be empty, for the caller to refuse."""
    function, scoped, name = text.partition(SCOPE)
    return (function, name) if scoped else (None, text)


def scope_matches(scope: str, function: str) -> bool:
    """Whether an overlay's ``FUNCTION::`` scope names ``function``: its exact name, or its ``stable_name``."""
    return scope == function or scope == stable_name(function)


def _output_args(node_def: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef) -> list[tuple[str, int]]:
    """(output arg name, index within the arg) for each output port of the node."""
    if support.registered_op_def(node_def.op) is op_def:
        fixed = _fixed_output_args(node_def.op)
        if fixed is not None:
            return list(fixed)
    ports = []
    for arg in op_def.output_arg:
        count = arg_port_count(node_def, op_def, arg)
        if count is None:
            raise GraphError(f"node '{node_def.name}' ({node_def.op}): attribute"
                             f" '{arg.type_list_attr or arg.number_attr}' is missing")
        ports.extend((arg.name, i) for i in range(count))
    return ports


def output_names(node_def: node_def_pb2.NodeDef, library: Mapping[str, op_def_pb2.OpDef]) -> list[str]:
    """What a FunctionDef's inputs call each output of ``node_def``, by port: ``node:output_arg:index``."""
    suffixes = None if node_def.op in library else _fixed_output_suffixes(node_def.op)
    if suffixes is not None:
        return [node_def.name + suffix for suffix in suffixes]
    op_def = support.resolve_op_def(node_def, library)
    return [f"{node_def.name}:{arg}:{index}" for arg, index in _output_args(node_def, op_def)]


@functools.lru_cache(maxsize=None)
def _fixed_output_suffixes(op: str) -> tuple[str, ...] | None:
    """``:output_arg:index`` of each output of a registered op whose attrs do not set their number, else None."""
    fixed = _fixed_output_args(op) if support.registered_op_def(op) is not None else None
    return None if fixed is None else tuple(f":{arg}:{index}" for arg, index in fixed)


@functools.lru_cache(maxsize=None)
def _fixed_output_args(op: str) -> tuple[tuple[str, int], ...] | None:
    """A registered op's output ports when no attr sets their number, else None."""
    op_def = support.registered_op_def(op)
    if any(arg.type_list_attr or arg.number_attr for arg in op_def.output_arg):
        return None
    return tuple((arg.name, 0) for arg in op_def.output_arg)


def is_parametrized(function: function_pb2.FunctionDef) -> bool:
    """Types or attrs fixed only by the caller: grappler leaves such bodies alone."""
    signature = function.signature
    for arg in list(signature.input_arg) + list(signature.output_arg):
        if arg.type_attr or arg.type_list_attr or arg.number_attr:
            return True
    return any(value.placeholder for node in function.node_def for value in node.attr.values())


@functools.lru_cache(maxsize=None)
def _may_call(op: str) -> bool:
    """Whether a node of ``op`` can name a function in an attr: a registered op with a
    ``func``/``list(func)`` attr, or an unregistered op (a library function's call)."""
    op_def = support.registered_op_def(op)
    return op_def is None or any(a.type in ("func", "list(func)") for a in op_def.attr)


def called_functions(node_def: node_def_pb2.NodeDef) -> Iterator[str]:
    """The names ``node_def`` calls as functions: its op (a call of a library function has
    the function's name as op) and each ``func`` and ``list(func)`` attr value.

    TensorFlow's rule for which library functions a graph reaches (``ReachableFunctions``
    in core/framework/function.cc, which grappler's meta-optimizer uses): the names in a
    ``func`` value's own attrs are not followed. They bind the callee's func attrs, and a
    callee that reads one through a placeholder is parametrized, which grappler leaves
    alone. Callers keep the names their library holds (the op is yielded whatever it is).
    The attrs of a registered op whose definition has no func attr are not read (most
    nodes: reading them all is a large share of the pass on a big graph); only a private
    ``_`` attr could name a function there, and TensorFlow writes none that does.
    """
    yield node_def.op
    if not _may_call(node_def.op):
        return
    for value in node_def.attr.values():
        kind = value.WhichOneof("value")
        if kind == "func":
            yield value.func.name
        elif kind == "list":
            yield from (function.name for function in value.list.func)


def rename_calls(node_def: node_def_pb2.NodeDef, old_to_new: Mapping[str, str]) -> None:
    """Make ``node_def`` call ``old_to_new``'s new names instead of the old ones, in place:
    exactly the names ``called_functions`` yields."""
    node_def.op = old_to_new.get(node_def.op, node_def.op)
    if not _may_call(node_def.op):
        return
    for value in node_def.attr.values():
        kind = value.WhichOneof("value")
        functions = [value.func] if kind == "func" else list(value.list.func) if kind == "list" else []
        for function in functions:
            function.name = old_to_new.get(function.name, function.name)


def _called_functions(nodes: Iterable[node_def_pb2.NodeDef], names: Container[str]) -> Iterator[str]:
    """The functions of ``names`` that ``nodes`` call."""
    for node in nodes:
        yield from (name for name in called_functions(node) if name in names)


def reachable_functions(
    graph_def: graph_pb2.GraphDef, library: Mapping[str, function_pb2.FunctionDef] | None = None, *,
    roots: Iterable[str] = (),
) -> list[str]:
    """Library functions grappler optimizes, in library order (spec §1.2).

    Reachable from the main graph through calls, function attrs and registered
    gradients; minus what ``XlaLaunch`` compiles, parametrized and tf.data functions.
    ``library``: ``graph_def``'s functions by name where the caller has them (``Program.library``).
    ``roots``: functions called from outside the graph, reached as the main graph's calls
    are: a SavedModel's restored functions, which ``tf.saved_model.load`` calls by name
    (``loaded.serve``, a module's ``@tf.function`` attribute). No node of the main graph
    calls them, but TensorFlow optimizes each as its own item whenever it runs it.
    """
    library = _by_name(graph_def) if library is None else library
    if not library:  # nothing to reach: skip reading every node's attrs
        return []
    gradients = {g.function_name: g.gradient_func for g in graph_def.library.gradient}

    def closure(start: Iterable[str]) -> set[str]:
        seen: set[str] = set()
        stack = [name for name in start if name in library]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            stack.extend(_called_functions(library[name].node_def, library))
            if gradients.get(name) in library:
                stack.append(gradients[name])
        return seen

    reachable = closure(itertools.chain(_called_functions(graph_def.node, library), roots))
    xla_roots = [
        node.attr["function"].func.name
        for node in list(graph_def.node) + [n for name in reachable for n in library[name].node_def]
        if node.op == "XlaLaunch" and "function" in node.attr
    ]
    compiled = closure(xla_roots)
    return [
        name for name in library
        if name in reachable and name not in compiled and not is_parametrized(library[name])
        and not (library[name].attr.get("_tf_data_function") and library[name].attr["_tf_data_function"].b)
    ]


# Functional ops: the attrs naming their functions, and the type attrs their signatures must match.
_CALL_SIGNATURES = {
    "PartitionedCall": (("f", "Tin", "Tout"),),
    "StatefulPartitionedCall": (("f", "Tin", "Tout"),),
    "While": (("body", "T", "T"), ("cond", "T", None)),
    "StatelessWhile": (("body", "T", "T"), ("cond", "T", None)),
    "If": (("then_branch", "Tin", "Tout"), ("else_branch", "Tin", "Tout")),
    "StatelessIf": (("then_branch", "Tin", "Tout"), ("else_branch", "Tin", "Tout")),
}


def _arg_types(args) -> list[int] | None:
    types = [arg.type for arg in args]
    return None if any(arg.type_attr or arg.type_list_attr or arg.number_attr for arg in args) else types


def check_calls(graph_def: graph_pb2.GraphDef, library: Mapping[str, function_pb2.FunctionDef] | None = None) -> None:
    """Every called function exists, matches its caller's types, and no call is recursive.

    Raises ``GraphError`` naming the function; grappler would fail later, less clearly.
    ``library`` as for ``reachable_functions``.
    """
    library = _by_name(graph_def) if library is None else library
    _check_call_nodes(graph_def.node, "", library)
    for function in graph_def.library.function:
        _check_call_nodes(function.node_def, f" in function '{function.signature.name}'", library)
    _check_not_recursive(library)


def _check_call_nodes(
    nodes: Sequence[node_def_pb2.NodeDef], where: str, library: Mapping[str, function_pb2.FunctionDef]
) -> None:
    """Each call node of one item (``where`` names it in errors) names a function that exists,
    with the types its caller's signature attrs say."""
    # Most graphs call nothing: their few distinct ops say so without a walk over the nodes.
    calling = {op for op in {node.op for node in nodes} if _may_call(op)}
    if not calling:
        return
    for node in nodes:
        if node.op not in calling:
            continue
        for name in called_functions(node):
            if name != node.op and name not in library and support.registered_op_def(name) is None:
                raise GraphError(
                    f"function '{name}' called by node '{node.name}'{where} is not in the graph's library;"
                    " export the graph with its functions"
                )
        for attr_name, in_attr, out_attr in _CALL_SIGNATURES.get(node.op, ()):
            function = library.get(node.attr[attr_name].func.name) if attr_name in node.attr else None
            if function is None:
                continue
            expected_in = list(node.attr[in_attr].list.type)
            actual_in = _arg_types(function.signature.input_arg)
            actual_out = _arg_types(function.signature.output_arg)
            expected_out = list(node.attr[out_attr].list.type) if out_attr else None
            if actual_in is not None and actual_in != expected_in or (
                out_attr and actual_out is not None and actual_out != expected_out
            ):
                raise GraphError(
                    f"function '{function.signature.name}' ({attr_name} of {node.op} node '{node.name}'{where})"
                    f" has a signature that does not match the node's '{in_attr}'"
                    f"{'/' + out_attr if out_attr else ''} types; re-export the graph"
                )


def _check_not_recursive(library: Mapping[str, function_pb2.FunctionDef]) -> None:
    """No function of ``library`` calls itself, directly or through others."""
    calls = {
        name: set(_called_functions(f.node_def, library)) for name, f in library.items()
    }
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for callee in sorted(calls[name]):
            if state.get(callee) == 1:
                cycle = path[path.index(callee):] + [callee]
                raise GraphError(
                    f"function '{callee}' is recursive ({' -> '.join(cycle)}); recursive functions cannot be rewritten"
                )
            if callee not in state:
                visit(callee, path + [callee])
        state[name] = 2

    for name in library:
        if name not in state:
            visit(name, [name])


def _by_name(graph_def: graph_pb2.GraphDef) -> dict[str, function_pb2.FunctionDef]:
    return {function.signature.name: function for function in graph_def.library.function}


def body_graph_def(function: function_pb2.FunctionDef, library: Mapping[str, op_def_pb2.OpDef]) -> graph_pb2.GraphDef:
    """The body as a GraphDef: ``_Arg`` nodes named after the inputs, ``_Retval`` per output."""
    name = function.signature.name
    graph_def = graph_pb2.GraphDef()
    for index, arg in enumerate(function.signature.input_arg):
        node = graph_def.node.add()
        node.CopyFrom(_boundary_node("_Arg", arg.type, index))
        node.name = arg.name
    ports: dict[str, str] = {arg.name: arg.name for arg in function.signature.input_arg}
    for node_def in function.node_def:
        op_def = support.resolve_op_def(node_def, library)
        for port, (arg, index) in enumerate(_output_args(node_def, op_def)):
            ports[f"{node_def.name}:{arg}:{index}"] = f"{node_def.name}:{port}"

    args = {arg.name for arg in function.signature.input_arg}

    def local(tensor: str, consumer: str) -> str:
        if tensor.startswith("^"):
            return tensor
        if tensor in ports:
            return ports[tensor]
        if tensor.endswith(":0") and tensor[:-2] in args:
            return tensor[:-2]
        raise GraphError(f"function '{name}', node '{consumer}': input '{tensor}' names no argument or node output")

    for node_def in function.node_def:
        node = graph_def.node.add()
        node.CopyFrom(node_def)
        node.input[:] = [local(t, node_def.name) for t in node_def.input]
    for index, arg in enumerate(function.signature.output_arg):
        if arg.name not in function.ret:
            raise GraphError(f"function '{name}': output '{arg.name}' has no value in 'ret'")
        node = graph_def.node.add()
        node.CopyFrom(_boundary_node("_Retval", arg.type, index))
        node.name = arg.name + RETVAL_SUFFIX
        node.input.append(local(function.ret[arg.name], node.name))
    return graph_def


@functools.lru_cache(maxsize=None)
def _boundary_node(op: str, dtype: int, index: int) -> node_def_pb2.NodeDef:
    """An ``_Arg`` or ``_Retval`` NodeDef but its name and input, built by ``make_node_def`` once per
    dtype and index (a body has one per argument and output, and copying one is far cheaper than
    building it); copied, never changed. Its dtype goes in as an AttrValue: a parametrized
    function's argument has none (DT_INVALID), which a typed ``type`` attr refuses."""
    return make_node_def(op, "", T=attr_value_pb2.AttrValue(type=dtype), index=index)


def preserved_nodes(function: function_pb2.FunctionDef, body: graph_pb2.GraphDef) -> list[str]:
    """A function item's preserved set: outputs, control outputs and every stateful op."""
    preserved = [arg.name + RETVAL_SUFFIX for arg in function.signature.output_arg]
    preserved += list(function.control_ret.values())
    for node in body.node:
        op_def = support.registered_op_def(node.op)
        if op_def is not None and op_def.is_stateful:
            preserved.append(node.name)
    return preserved


def to_function_def(
    body: graph_pb2.GraphDef, function: function_pb2.FunctionDef, library: Mapping[str, op_def_pb2.OpDef]
) -> function_pb2.FunctionDef:
    """A rewritten body back into ``function``'s FunctionDef: new nodes and ``ret``; argument
    types from the ``_Arg``/``_Retval`` nodes (they only change with ``cross_function``)."""
    args = {node.name for node in body.node if node.op == "_Arg"}
    node_defs = {node.name: node for node in body.node}
    output_names: dict[str, list[tuple[str, int]]] = {}

    def function_tensor(tensor: str) -> str:
        ref = parse_tensor_name(tensor)
        if ref.port == CONTROL or ref.node in args:
            return tensor if ref.port == CONTROL else ref.node
        if ref.node not in output_names:
            node_def = node_defs[ref.node]
            output_names[ref.node] = _output_args(node_def, support.resolve_op_def(node_def, library))
        arg, index = output_names[ref.node][ref.port]
        return f"{ref.node}:{arg}:{index}"

    rewritten = function_pb2.FunctionDef()
    rewritten.CopyFrom(function)
    del rewritten.node_def[:]
    signature = rewritten.signature
    for node in body.node:
        if node.op == "_Arg":
            signature.input_arg[node.attr["index"].i].type = node.attr["T"].type
            continue
        if node.op == "_Retval":
            signature.output_arg[node.attr["index"].i].type = node.attr["T"].type
            rewritten.ret[node.name[: -len(RETVAL_SUFFIX)]] = function_tensor(node.input[0])
            continue
        copy = rewritten.node_def.add()
        copy.CopyFrom(node)
        copy.input[:] = [function_tensor(t) for t in node.input]
    return rewritten
