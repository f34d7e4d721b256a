"""FP8 training inside while loops: a loop body's matmuls on float8, one history per matmul;
and the rewrite of one training step with its loops (``training_step_rewritten``).

A recurrent layer (Keras' LSTM/GRU on the TensorFlow backend, ``tf.while_loop``, ``tf.scan``)
traces its step as a ``While`` whose body holds the forward matmuls; the gradient is another
``While`` of the same step whose body holds the backward ones. The state of a loop matmul's
operands lives, as every state does, in the step (``training.State``); the loops get it
as loop variables of their own, added here to each ``While`` node, its body and its cond:

* per key a float32 *given scale* (the delayed scale, or 0 while the history is empty: then
  each iteration scales from its own amax), passed through unchanged, and
* per recorded key a float32 *amax*, 0 on entry, the largest |x| of every iteration's chains
  on exit (+Inf where one was not finite).

The body's chains quantize with the given scale (``training.ChainBuilder.chain``);
the step's update of the key records the ``While``'s amax output beside the amax of the key's
chains in the step itself (Keras' LSTM runs its first time step outside the loop, with the same
weights): one history per matmul across iterations, its amax the largest over iterations.

Which backward matmul is whose: a backward matmul in the gradient body lives in the name scope
of its forward matmul's gradient (``…/gradients/<forward>_grad/…``), as outside loops; its
forward operand is the forward operand the forward body pushed to an accumulator
(``TensorListPushBack``) and it pops (``TensorListPopBack``), followed through the two
``While`` nodes of the step. It is quantized again with the forward key's scale, giving the
forward chain's values.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2, tensor_shape_pb2, types_pb2

from amp_rewrite.core.float8.formats import E4M3, E5M2, MATMUL_OPS, Format
from amp_rewrite.core.float8.nodes import origin
from amp_rewrite.core.float8.training import (
    BACKWARD_OPS, BASE_DTYPES, OPERAND_POSITIONS, STATE_SCOPE, Backward, ChainBuilder, Matmul, Plan, State, Workers,
    forward_names, in_gradient_scope, quantize_training_step, variable_handle, weight_of,
)
from amp_rewrite.core.functions import LOOP_OPS, RETVAL_SUFFIX, scoped_name, to_function_def
from amp_rewrite.core.graph_io import copy_graph_def, data_inputs, make_node_def, parse_tensor_name, tensor_name
from amp_rewrite.core.program import MAIN_GRAPH, Program, program_of
from amp_rewrite.core.report import Report
from amp_rewrite.core.rules import Reason, Rule


@dataclass(frozen=True)
class Loop:
    """A ``While`` of a step whose body holds forward matmuls the base rewrite converts, and the
    ``While`` of the same step that takes their gradient (None where the step takes none).
    ``sources``: body matmul -> the step's node its weight variable's handle comes from."""

    node: str
    body: str
    cond: str
    matmuls: tuple[Matmul, ...]
    sources: Mapping[str, str] = field(default_factory=dict)
    gradient: str | None = None
    gradient_body: str | None = None
    gradient_cond: str | None = None

    def name(self, matmul: Matmul) -> str:
        """``matmul``'s name in the step's key bases (a body's names may repeat the step's):
        ``BODY::node``, as ``inference.key_text`` and lists' keep_nodes scope a name."""
        return scoped_name(self.body, matmul.node)

    def with_bases(self, node_to_base: Mapping[str, str]) -> Loop:
        return replace(self, matmuls=tuple(replace(m, base=node_to_base.get(self.name(m), "")) for m in self.matmuls))


def find_loops(program: Program, function: str, converted: Callable[[str], frozenset[str]]) -> tuple[Loop, ...]:
    """The loops of item ``function`` (before the rewrite) with converted forward matmuls in their
    bodies (``converted(item)``: the nodes the base rewrite converts there), paired with the
    backward matmuls of the loop that takes their gradient. Loops inside loop bodies are not
    looked into."""
    step = program.item(function)
    step_nodes = {node.name: node for node in step.node}
    loops = [node for node in step.node if node.op in LOOP_OPS]
    found = []
    for node in loops:
        body = node.attr["body"].func.name
        matmuls, sources = _forward_matmuls(program, body, converted(body), node, step_nodes)
        if not matmuls:
            continue
        loop = Loop(node.name, body, node.attr["cond"].func.name, tuple(matmuls.values()), sources)
        found.append(_with_gradient(program, loop, [other for other in loops if other is not node], step_nodes,
                                    converted))
    return tuple(found)


def _forward_matmuls(program: Program, body: str, converted: frozenset[str], loop: node_def_pb2.NodeDef,
                     step_nodes: Mapping[str, node_def_pb2.NodeDef]) -> tuple[dict[str, Matmul], dict[str, str]]:
    """The converted forward matmuls of ``body`` (no Const operand: see ``find_matmuls``) and the
    step's handle node of each one's weight variable, followed in through the loop's inputs."""
    nodes = {node.name: node for node in program.item(body).node}
    matmuls, sources = {}, {}
    for node in program.item(body).node:
        inputs = data_inputs(node)
        if (node.op not in MATMUL_OPS or node.name not in converted or in_gradient_scope(node.name)
                or len(inputs) != MATMUL_OPS[node.op]):
            continue
        if any(origin(nodes, parse_tensor_name(t).node).op == "Const" for t in inputs):
            continue
        found = [(index, _step_handle(nodes, step_nodes, loop, tensor)) for index, tensor in enumerate(inputs)]
        weight = next(((index, source) for index, source in found if source is not None), None)
        matmuls[node.name] = Matmul(node.name, node.op, tuple(tensor_name(*parse_tensor_name(t)) for t in inputs),
                                    weight=weight[0] if weight else None)
        if weight:
            sources[node.name] = weight[1]
    return matmuls, sources


def _step_handle(nodes: Mapping[str, node_def_pb2.NodeDef], step_nodes: Mapping[str, node_def_pb2.NodeDef],
                 loop: node_def_pb2.NodeDef, tensor: str) -> str | None:
    """The step's node a body operand's variable handle comes from: the body reads the variable
    (``ReadVariableOp`` of a resource argument) or takes its value (a float argument read in
    the step); either argument is the loop's input of that index."""
    source = origin(nodes, parse_tensor_name(tensor).node)
    if source.op == "ReadVariableOp":
        source = origin(nodes, parse_tensor_name(source.input[0]).node)
    if source.op != "_Arg":
        return None
    outer = loop.input[source.attr["index"].i]
    found = weight_of(step_nodes, [outer])  # the value, read in the step
    return found[0][1] if found else variable_handle(step_nodes, outer)  # or the variable itself


@dataclass(frozen=True)
class _Candidate:
    """Another ``While`` of the step that may take ``loop``'s gradient, and the nodes that pairing
    their matmuls reads: the candidate's body, the forward body and the step."""

    program: Program
    loop: Loop
    gradient: node_def_pb2.NodeDef
    body_nodes: Mapping[str, node_def_pb2.NodeDef]
    forward_nodes: Mapping[str, node_def_pb2.NodeDef]
    step_nodes: Mapping[str, node_def_pb2.NodeDef]


def _with_gradient(program: Program, loop: Loop, others: list[node_def_pb2.NodeDef],
                   step_nodes: Mapping[str, node_def_pb2.NodeDef], converted: Callable[[str], frozenset[str]]) -> Loop:
    """``loop`` with the backward matmuls of the first other loop whose body computes its gradient."""
    forward = {matmul.node: matmul for matmul in loop.matmuls}
    forward_nodes = {node.name: node for node in program.item(loop.body).node}
    for other in others:
        body = other.attr["body"].func.name
        backward: dict[str, list[Backward]] = {}
        candidate = _Candidate(program, loop, other, {node.name: node for node in program.item(body).node},
                               forward_nodes, step_nodes)
        for node in program.item(body).node:
            if node.op in OPERAND_POSITIONS and in_gradient_scope(node.name) and node.name in converted(body):
                found = _backward_of(candidate, node, forward)
                if found is not None:
                    backward.setdefault(found[0], []).append(found[1])
        if backward:
            matmuls = tuple(replace(m, backward=tuple(backward.get(m.node, ()))) for m in loop.matmuls)
            return replace(loop, matmuls=matmuls, gradient=other.name, gradient_body=body,
                           gradient_cond=other.attr["cond"].func.name)
    return loop


def _backward_of(candidate: _Candidate, node: node_def_pb2.NodeDef,
                 forward: Mapping[str, Matmul]) -> tuple[str, Backward] | None:
    """The forward matmul whose gradient the candidate body's ``node`` computes (by name scope) and
    how it reads it: which operand it pops from the forward body's accumulator of which input."""
    positions = OPERAND_POSITIONS[node.op]
    if len(node.input) <= max(positions):
        return None
    name = _forward_name(node, forward)
    if name is None:
        return None
    for index, position in enumerate(positions):
        pushed = _pushed(candidate, node.input[position])
        if pushed in forward[name].inputs:
            return name, Backward(node.name, position, forward[name].inputs.index(pushed), positions[1 - index])
    return None


def _forward_name(node: node_def_pb2.NodeDef, forward: Mapping[str, Matmul]) -> str | None:
    """The forward matmul named by the gradient scope ``node`` sits in (``…/<forward>_grad/…``)."""
    return next((name for name in forward_names(node.name)
                 if name in forward and node.op in BACKWARD_OPS[forward[name].op]), None)


def _pushed(candidate: _Candidate, tensor: str) -> str | None:
    """The forward body's tensor that the candidate body's ``tensor`` pops (``TensorListPopBack`` of
    an accumulator argument ← the candidate loop's input ← the forward loop's output ← the forward
    body's ``TensorListPushBack``), or None where it pops none."""
    pop = origin(candidate.body_nodes, parse_tensor_name(tensor).node)
    if pop.op != "TensorListPopBack":
        return None
    argument = origin(candidate.body_nodes, parse_tensor_name(pop.input[0]).node)
    if argument.op != "_Arg":
        return None
    outer = parse_tensor_name(candidate.gradient.input[argument.attr["index"].i])
    if origin(candidate.step_nodes, outer.node).name != candidate.loop.node:
        return None
    body = candidate.loop.body
    output = candidate.program.library[body].signature.output_arg[outer.port].name
    retval = candidate.forward_nodes.get(f"{output}{RETVAL_SUFFIX}")
    push = origin(candidate.forward_nodes, parse_tensor_name(retval.input[0]).node) if retval is not None else None
    if push is None or push.op != "TensorListPushBack":
        return None
    return tensor_name(*parse_tensor_name(push.input[1]))


# --- threading the state through the loops --------------------------------------------------


@dataclass(frozen=True)
class LoopAmax:
    """A loop's output holding the largest amax of one key over its iterations, for the step's update."""

    tensor: str
    fmt: Format
    dtype: int
    device: str


@dataclass
class _Threaded:
    """What ``_thread_loops`` changed: the step's new body, the loop functions' new bodies and
    FunctionDefs (by name), each key's loop amaxes, and the reasons of the matmuls it quantized
    (by item)."""

    step: graph_pb2.GraphDef
    functions: dict[str, function_pb2.FunctionDef] = field(default_factory=dict)
    amaxes: dict[str, list[LoopAmax]] = field(default_factory=dict)
    reasons: dict[str, dict[str, Reason]] = field(default_factory=dict)


@dataclass(frozen=True)
class _LoopToThread:
    """One ``While`` node of the step to thread, with its body and cond: the keys its body
    quantizes (with their formats), those whose amax its outputs carry to the step's update
    (``record``), and how its body quantizes (``quantize``: builder, key -> given scale -> reasons)."""

    node: str
    body: str
    cond: str
    keys: Mapping[str, Format]
    record: frozenset[str]
    quantize: Callable[[ChainBuilder, Mapping[str, str]], dict[str, Reason]]


def _thread_loops(program: Program, step: graph_pb2.GraphDef, loops: tuple[Loop, ...], state: Mapping[str, State],
                  history_length: int) -> _Threaded:
    """The loops of ``step`` (an item after the base rewrite, not modified) with their matmuls on
    float8 (the module doc). ``program``: the rewrite's output, whose library holds the bodies."""
    output = copy_graph_def(step)
    threaded = _Threaded(output)
    step_writer = ChainBuilder(output, {node.name: node for node in output.node}, history_length)
    for loop in loops:
        forward_keys = _keys(loop.matmuls, backward=False)
        _thread(program, step_writer, threaded, state, _LoopToThread(
            loop.node, loop.body, loop.cond, forward_keys, frozenset(forward_keys),
            lambda builder, scales: _quantize_forward(builder, scales, loop)))
        if loop.gradient is not None:
            gradient_keys = _keys(loop.matmuls, backward=True)
            _thread(program, step_writer, threaded, state, _LoopToThread(
                loop.gradient, loop.gradient_body, loop.gradient_cond, {**gradient_keys, **forward_keys},
                frozenset(gradient_keys), lambda builder, scales: _quantize_backward(builder, scales, loop)))
    return threaded


def _keys(matmuls: tuple[Matmul, ...], backward: bool) -> dict[str, Format]:
    """The keys the forward chains (or, ``backward``, the incoming gradients) of ``matmuls`` quantize."""
    if backward:
        return {m.key(None): E5M2 for m in matmuls if m.backward}
    return {m.key(index): E4M3 for m in matmuls for index in (0, 1)}


def _thread(program: Program, step_writer: ChainBuilder, threaded: _Threaded, state: Mapping[str, State],
            loop: _LoopToThread) -> None:
    """``loop``'s node gains a given scale and an amax per key with a state; its body quantizes
    with them (``loop.quantize``); the amax outputs of the keys to ``loop.record`` go to the step's update."""
    keys = [key for key in loop.keys if key in state]
    node_name, body, cond, record = loop.node, loop.body, loop.cond, loop.record
    loop_node = step_writer.nodes[node_name]
    first = len(loop_node.attr["T"].list.type)
    device = loop_node.device
    f32 = types_pb2.DT_FLOAT
    zero = step_writer.const(f"{STATE_SCOPE}/{node_name}/amax_zero", 0.0, f32, device)
    for key in keys:
        loop_node.input.extend([step_writer.given_scale(key, state[key], device), zero])
    _add_loop_variables(loop_node, 2 * len(keys))
    body_graph = copy_graph_def(program.item(body))
    arguments = _add_arguments(body_graph, first, [name for key in keys for name in (f"{key}:scale", f"{key}:amax")])
    builder = ChainBuilder(body_graph, {node.name: node for node in body_graph.node}, 1)
    threaded.reasons[body] = loop.quantize(builder, {key: arguments[f"{key}:scale"] for key in keys})
    outputs = []
    for key in keys:
        outputs.append(arguments[f"{key}:scale"])
        outputs.append(_iteration_amax(builder, key, arguments[f"{key}:amax"]) if key in record and key in
                       builder.amaxes else arguments[f"{key}:amax"])
    _add_outputs(body_graph, first, outputs)
    threaded.functions[body] = _function(program, body, body_graph, 2 * len(keys), outputs=True)
    cond_graph = copy_graph_def(program.item(cond))
    _add_arguments(cond_graph, first, [f"{key}:{kind}" for key in keys for kind in ("scale", "amax")])
    threaded.functions[cond] = _function(program, cond, cond_graph, 2 * len(keys), outputs=False)
    for index, key in enumerate(keys):
        if key in record and key in builder.amaxes:
            fmt, dtype, _ = builder.formats[key]
            threaded.amaxes.setdefault(key, []).append(LoopAmax(f"{node_name}:{first + 2 * index + 1}", fmt, dtype,
                                                                device))


def _quantize_forward(builder: ChainBuilder, scales: Mapping[str, str], loop: Loop) -> dict[str, Reason]:
    reasons = {}
    for matmul in loop.matmuls:
        node = builder.nodes.get(matmul.node)
        dtype = node.attr["T"].type if node is not None else None
        if dtype not in BASE_DTYPES:
            continue
        for index in (0, 1):
            node.input[index] = builder.chain(matmul.key(index), E4M3, node.input[index], dtype, None,
                                              scales.get(matmul.key(index)))
        reasons[matmul.node] = Reason(Rule.FLOAT8_TRAINING, f"inputs {E4M3.name} in loop {loop.node}, one amax history"
                                      " across its iterations" if matmul.key(0) in scales else
                                      f"inputs {E4M3.name} in loop {loop.node}, scales from each iteration's amax")
    return reasons


def _quantize_backward(builder: ChainBuilder, scales: Mapping[str, str], loop: Loop) -> dict[str, Reason]:
    reasons = {}
    for matmul in loop.matmuls:
        for backward in matmul.backward:
            node = builder.nodes[backward.node]
            dtype = node.attr["T"].type
            if dtype not in BASE_DTYPES:
                continue
            forward_key, gradient_key = matmul.key(backward.forward_input), matmul.key(None)
            node.input[backward.operand_position] = builder.chain(
                forward_key, E4M3, node.input[backward.operand_position], dtype, None, scales.get(forward_key))
            node.input[backward.gradient_position] = builder.chain(
                gradient_key, E5M2, node.input[backward.gradient_position], dtype, None, scales.get(gradient_key))
            reasons[backward.node] = Reason(
                Rule.FLOAT8_TRAINING, f"gradient of {matmul.node} in loop {loop.gradient}: the incoming gradient"
                f" {E5M2.name}, input {backward.forward_input} {E4M3.name} as in the forward matmul", matmul.node)
    return reasons


def _iteration_amax(builder: ChainBuilder, key: str, entering: str) -> str:
    """The largest of ``entering`` (the loop variable) and this iteration's amax of ``key``; a
    non-finite amax as +Inf, so that the step's update does not record it."""
    f32 = types_pb2.DT_FLOAT
    device = builder.formats[key][2]
    amax = builder.local_amax(key)
    base = f"{STATE_SCOPE}/{key}/iterations"
    finite = builder.add(f"{base}/finite", "IsFinite", [amax], device, {"T": f32})
    guarded = builder.add(f"{base}/guarded", "SelectV2", [finite, amax, builder.const(
        f"{base}/infinity", float("inf"), f32, device)], device, {"T": f32})
    return builder.add(f"{base}/largest", "Maximum", [entering, guarded], device, {"T": f32})


def _add_loop_variables(loop_node: node_def_pb2.NodeDef, count: int) -> None:
    """``count`` more float32 scalar loop variables on ``loop_node`` (its inputs are added by the caller)."""
    loop_node.attr["T"].list.type.extend([types_pb2.DT_FLOAT] * count)
    if "output_shapes" in loop_node.attr:
        loop_node.attr["output_shapes"].list.shape.extend([tensor_shape_pb2.TensorShapeProto()] * count)
    if "_num_original_outputs" in loop_node.attr:
        loop_node.attr["_num_original_outputs"].i += count


def _add_arguments(body: graph_pb2.GraphDef, first: int, names: list[str]) -> dict[str, str]:
    """``_Arg`` nodes ``first``, ``first + 1``, … (float32) for ``names``; returns name -> node."""
    return {name: make_node_def("_Arg", f"amp_float8_arg_{index}", into=body.node, T=types_pb2.DT_FLOAT,
                                index=index).name
            for index, name in enumerate(names, start=first)}


def _add_outputs(body: graph_pb2.GraphDef, first: int, tensors: list[str]) -> None:
    """``_Retval`` nodes ``first``, ``first + 1``, … (float32) returning ``tensors``."""
    for index, tensor in enumerate(tensors, start=first):
        make_node_def("_Retval", f"amp_float8_out_{index}{RETVAL_SUFFIX}", [tensor], into=body.node,
                      T=types_pb2.DT_FLOAT, index=index)


def _function(program: Program, name: str, body: graph_pb2.GraphDef, count: int,
              outputs: bool) -> function_pb2.FunctionDef:
    """Function ``name`` rebuilt from ``body`` with ``count`` more float32 inputs (and outputs)."""
    extended = function_pb2.FunctionDef()
    extended.CopyFrom(program.library[name])
    first = len(extended.signature.input_arg)
    for offset in range(count):
        extended.signature.input_arg.add(name=f"amp_float8_arg_{first + offset}", type=types_pb2.DT_FLOAT)
        if outputs:
            extended.signature.output_arg.add(name=f"amp_float8_out_{first + offset}", type=types_pb2.DT_FLOAT)
    return to_function_def(body, extended, program.op_defs)


# --- one step with its loops ------------------------------------------------------------------


def training_step_rewritten(result_graph_def: graph_pb2.GraphDef, report: Report, function: str, plan: Plan,
                            state: Mapping[str, State], history_length: int, *, workers: Workers | None = None,
                            loops: tuple[Loop, ...] = ()) -> tuple[graph_pb2.GraphDef, Report]:
    """``training.quantize_training_step`` on one item of a rewrite's output (``function``: a
    library function's name, or ``MAIN_GRAPH``) and, in a function, its ``loops`` (``_thread_loops``),
    with the report's reasons and counts for each item."""
    program = program_of(result_graph_def)
    step, functions, item_reasons, loop_amaxes = program.item(function), {}, {}, {}
    if loops and function != MAIN_GRAPH:
        threaded = _thread_loops(program, step, loops, state, history_length)
        step, functions, item_reasons, loop_amaxes = (threaded.step, threaded.functions, threaded.reasons,
                                                      threaded.amaxes)
    body, reasons, control_outputs = quantize_training_step(step, plan, state, history_length, workers=workers,
                                                            in_function=function != MAIN_GRAPH, loop_amaxes=loop_amaxes)
    item_reasons[function] = reasons
    output = copy_graph_def(result_graph_def)
    program.put(output, function, body)
    for name, rewritten in functions.items():
        output.library.function[program.positions[name]].CopyFrom(rewritten)
    if control_outputs:
        rewritten = output.library.function[program.positions[function]]
        for name in control_outputs:
            rewritten.signature.control_output.append(name)
            rewritten.control_ret[name] = name
    return output, _report_with(report, item_reasons)


def _report_with(report: Report, item_reasons: Mapping[str, Mapping[str, Reason]]) -> Report:
    """``report`` with each item's float8 matmuls counted and their reasons as overrides."""
    items = tuple(replace(item, float8_matmuls=len(item_reasons[item.function])) if item.function in item_reasons
                  else item for item in report.items)
    pending = tuple(replace(item, overrides={**item.overrides, **{(node, "T"): reason for node, reason
                                                                  in item_reasons[item.function].items()}})
                    if item.function in item_reasons else item for item in report.pending)
    return Report(report.target, items, pending)
