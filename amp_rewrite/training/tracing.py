"""What the live rewrite does with each new trace: rewrite its FunctionDef and register it.

TensorFlow calls ``CONCRETE_FUNCTION_CALLBACKS`` with each new ConcreteFunction, after its
FunctionDef is registered in the eager context and before its first call. ``on_new_function``
rewrites that FunctionDef and the library functions it calls (loop bodies, branches, nested
calls) and registers the rewritten ones under the same names, so every call — custom
training loops, ``model.fit``/``evaluate``/``predict``, and ``jit_compile=True`` functions,
which XLA compiles from the registered body — runs them. ``on_new_graph`` (a
``FUNC_GRAPH_TRANSFORMS`` hook, before the FunctionDef exists) prepares FP8 training's state.
Both act for the enablement given to them (``live``), which owns their settings and warnings.
"""
from __future__ import annotations

import logging
import re
import warnings
from typing import Any, Mapping

import keras
import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2

from amp_rewrite import _tf
from amp_rewrite.core import functions
from amp_rewrite.core.graph_io import make_node_def
from amp_rewrite.core.lists import OpLists
from amp_rewrite.core.rewrite import rewrite_graph_def
from amp_rewrite.core.target import lookup_target
from amp_rewrite.training import float8
from amp_rewrite.tuning.cache import training_cache
from amp_rewrite.tuning.decide import cached_keeps
from amp_rewrite.tuning.shapes import traced_inputs

log = logging.getLogger(__name__)

# The first TensorFlow release whose XLA compiles the FunctionDef registered under a
# jit_compile=True function's name when it is called on its own; older ones compile the
# body as traced (it still works for one called from another function, as Keras' steps
# are), so there the rewrite warns (tools/matrix.py, tests/test_live.py).
XLA_REWRITE_MIN_TENSORFLOW = (2, 18)


def mixed_keras_policy() -> str | None:
    """The name of a global mixed-precision Keras policy (Keras 3 or tf_keras), if one is set."""
    if _tf.USING_MIXED_PRECISION_POLICY.get()():
        return "a tf_keras mixed precision policy"
    name = keras.config.dtype_policy().name
    return name if name.startswith("mixed") else None


def compat_name(name: bytes | str) -> str:
    """A function name as ``str`` (TensorFlow hands out ``bytes`` and ``str``)."""
    return name.decode() if isinstance(name, bytes) else name


def on_new_function(concrete_function: Any, enablement: Any) -> None:
    """``CONCRETE_FUNCTION_CALLBACKS`` hook: rewrite ``concrete_function`` for ``enablement``
    (a ``live.Enablement``; None: the rewrite is off)."""
    if enablement is None:
        return
    settings = enablement.settings
    if mixed_keras_policy() and enablement.show_once("policy"):
        warnings.warn("amp_rewrite: a mixed precision Keras policy was set after enabling the graph rewrite;"
                      " the two must not be combined", stacklevel=2)
    function_def = concrete_function.function_def
    name = function_def.signature.name
    # ``in`` first: indexing the map would insert an empty attr into TensorFlow's cached
    # definition, which it copies onto call ops (model.export then fails to bind it).
    jit_compile = "_XlaMustCompile" in function_def.attr and function_def.attr["_XlaMustCompile"].b
    if jit_compile and _tf.tensorflow_version() < XLA_REWRITE_MIN_TENSORFLOW:
        warnings.warn(
            f"amp_rewrite: TensorFlow {tf.__version__} compiles a jit_compile=True function called on its own from"
            f" the body as traced, so {name} may run in float32; use TensorFlow"
            f" {'.'.join(map(str, XLA_REWRITE_MIN_TENSORFLOW))} or newer, or jit_compile=False", stacklevel=2)
    library = concrete_function.graph.as_graph_def().library
    step = float8.trace_step(concrete_function.graph) if settings.float8 is not None else None
    changed, float8_matmuls = rewrite_registered_function(name, library, settings, concrete_function.inference_fn, step,
                                                          concrete_function.graph)
    if float8_matmuls and not (jit_compile or step.under_xla or float8.xla_jit_enabled()) \
            and enablement.show_once("float8-emulated"):
        warnings.warn(float8.emulated_warning(name, float8_matmuls), stacklevel=2)
    if not changed and settings.target == "float16":
        _warn_if_cpu_placed(name, [function_def, *library.function], settings.lists, enablement)


def on_new_graph(func_graph: Any, enablement: Any, float8_states: Any) -> None:
    """``FUNC_GRAPH_TRANSFORMS`` hook: FP8 training's state for each traced FuncGraph, before its
    FunctionDef exists. ``float8_states``: the active enablements' FP8 states, newest last."""
    if enablement is not None and enablement.settings.float8 is not None:
        float8.prepare_trace(func_graph, enablement.settings.target, enablement.settings.lists, float8_states)


def _call_graph(function: function_pb2.FunctionDef, library: function_pb2.FunctionDefLibrary) -> graph_pb2.GraphDef:
    """A graph whose only work is one call of ``function``: its body becomes a function item."""
    graph_def = graph_pb2.GraphDef()
    graph_def.library.CopyFrom(library)
    if function.signature.name not in {f.signature.name for f in library.function}:
        graph_def.library.function.add().CopyFrom(function)
    signature = function.signature
    make_node_def("StatefulPartitionedCall", "call", [_input_name(index) for index in range(len(signature.input_arg))],
                  into=graph_def.node, f=signature.name, Tin=[arg.type for arg in signature.input_arg],
                  Tout=[arg.type for arg in signature.output_arg], config="", config_proto="", executor_type="")
    for index, arg in enumerate(signature.input_arg):
        make_node_def("Placeholder", _input_name(index), into=graph_def.node, dtype=arg.type)
    return graph_def


def _input_name(index: int) -> str:
    """The placeholder ``_call_graph`` feeds the function's input ``index`` from."""
    return f"input_{index}"


def _renamed_calls(function: function_pb2.FunctionDef, old_to_new: Mapping[str, str]) -> function_pb2.FunctionDef:
    """A copy of ``function`` calling ``old_to_new``'s new names (``functions.rename_calls``)."""
    copy = function_pb2.FunctionDef()
    copy.CopyFrom(function)
    for node in copy.node_def:
        functions.rename_calls(node, old_to_new)
    return copy


def private_name(name: str, owner: str) -> str:
    """The name of ``owner``'s private copy of ``name`` (owners' names are unique per trace)."""
    return f"{name}_amp_{owner}"


def private_copies(
    owner: str, original: Mapping[str, function_pb2.FunctionDef], rewritten: Mapping[str, function_pb2.FunctionDef]
) -> list[function_pb2.FunctionDef]:
    """The functions to register for ``owner``'s rewrite: ``owner`` itself, same name, and a
    private copy, named after ``owner``, of every library function it changed.

    A nested function is shared: callers traced earlier (before enabling, or under another
    rewrite) call it by name, and with ``cross_function`` its signature may change, so it is
    never replaced in place. A function that calls a changed one changes too, to call the copy.
    """
    def callees(function: function_pb2.FunctionDef) -> set[str]:
        return {name for node in function.node_def for name in functions.called_functions(node)} & set(rewritten)

    changed = {name for name, function in rewritten.items() if function != original[name]}
    name_to_callees = {name: callees(function) for name, function in rewritten.items()}
    while True:  # callers of changed functions change too
        more = {name for name, called in name_to_callees.items() if called & changed} - changed
        if not more:
            break
        changed |= more
    old_to_new = {name: private_name(name, owner) for name in sorted(changed) if name != owner}
    copies = []
    for name in sorted(changed):
        function = _renamed_calls(rewritten[name], old_to_new)
        function.signature.name = old_to_new.get(name, name)
        copies.append(function)
    return copies


def rewrite_registered_function(name: str, library: function_pb2.FunctionDefLibrary, settings: Any,
                                atomic: Any = None, step: float8.TraceStep | None = None,
                                func_graph: Any = None) -> tuple[int, int]:
    """Rewrite the registered function ``name`` in the eager context; its callees are rewritten
    into private copies (``private_copies``) that only the new ``name`` calls.

    Returns how many functions were registered and how many matmuls run on float8. The
    signature of ``name`` never changes. ``atomic``: ``name``'s AtomicFunction, whose children
    (the functions copied into a graph or SavedModel with it) gain the copies, which then live
    as long as it does. ``step``: FP8 training's findings in ``name``'s FuncGraph, for its float8 chains.
    ``func_graph``: that FuncGraph, whose input shapes and variables the timing cache's plan needs.
    """
    context = _tf.EAGER_CONTEXT.get()()
    function = context.get_function_def(name)
    graph_def = _call_graph(function, library)
    def rewrite(lists: OpLists) -> Any:
        return rewrite_graph_def(graph_def, target=settings.target, fetches=["call"], lists=lists,
                                 cross_function=settings.cross_function, entry_functions=[name])

    result = rewrite(settings.lists)
    keep = measured_keeps(graph_def, result, settings, func_graph) if settings.timing_cache is not None else {}
    if keep:
        result = rewrite(settings.lists.keeping(keep))
        log.debug("amp_rewrite: %s: %d node(s) kept float32 by the timing cache", name, len(keep))
    if step is not None and settings.float8 is not None:
        result = float8.quantize(graph_def, result, name, step, settings.float8)
    original = {f.signature.name: f for f in graph_def.library.function}
    rewritten = {f.signature.name: f for f in result.graph_def.library.function}
    copies = private_copies(name, original, rewritten)
    if not register(context, function, copies, atomic, {private_name(f, name): f for f in rewritten}):
        return 0, 0
    log.debug("amp_rewrite: %s: %s", name, result.report.summary())
    return len(copies), result.report.float8_matmuls


def measured_keeps(graph_def: graph_pb2.GraphDef, result: Any, settings: Any, func_graph: Any) -> dict[str, str]:
    """keep_nodes entries (-> the measurement) for what the timing cache (``settings.timing_cache``,
    read now: ``tune_step`` may have filled it since the rewrite was enabled) says runs slower
    converted in ``graph_def`` (``_call_graph``'s), nothing timed: a training step's path never
    waits for a timing. ``func_graph`` gives the call's input shapes as traced and its captured
    variables' dtypes and shapes; a node the cache does not know counts as neither faster nor
    slower (its neighbours decide)."""
    target = lookup_target(settings.target)
    cache = training_cache(settings.timing_cache, target.device_type)
    if func_graph is None or cache is None:
        return {}
    feed_shapes, variables = traced_inputs(func_graph)
    feeds = {_input_name(index): shape for index, shape in feed_shapes.items()}
    handles = {_input_name(index): variable for index, variable in variables.items()}
    kept = cached_keeps(graph_def, result, target, feeds, cache, handles)
    return {re.escape(node): why for (_, node), why in sorted(kept.items())}


def register(context: Any, function: function_pb2.FunctionDef, copies: list[function_pb2.FunctionDef],
             atomic: Any, copy_to_original: Mapping[str, str]) -> bool:
    """Register ``copies`` in ``context``: the private ones first (new names no caller knows yet),
    then the new body of ``function`` in place of the old one. If TensorFlow refuses one, the
    old body stays (or is registered again) and the private copies go: the function runs as
    traced, which a warning says; returns whether the rewrite is registered."""
    name = function.signature.name
    added: list[str] = []
    try:
        for copy in copies:
            copy_name = copy.signature.name
            if copy_name != name and not context.has_function(copy_name):
                context.add_function_def(copy)
                added.append(copy_name)
        for copy in copies:
            if copy.signature.name == name:
                _swap(context, function, copy)
    except tf.errors.OpError as error:
        for copy_name in added:
            context.remove_function(copy_name)
        warnings.warn(f"amp_rewrite: TensorFlow did not register the rewritten {name} ({error.message}), so it runs"
                      " as traced, without the rewrite; please report this", stacklevel=4)
        return False
    if atomic is not None:
        atomic_function = _tf.ATOMIC_FUNCTION.get()
        atomic.children.extend(atomic_function(copy_name, context, _child_type(atomic, copy_to_original[copy_name]))
                               for copy_name in added)
    return True


def _swap(context: Any, old: function_pb2.FunctionDef, new: function_pb2.FunctionDef) -> None:
    """Replace the registered ``old`` by ``new`` (same name); ``old`` is back if the add fails."""
    context.remove_function(old.signature.name)
    try:
        context.add_function_def(new)
    except tf.errors.OpError:
        context.add_function_def(old)
        raise


def _child_type(atomic: Any, original_name: str) -> Any:
    """The FunctionType of ``atomic``'s child ``original_name`` (a copy's dtypes may differ
    under cross_function; the type is kept only as the children's other entries have one)."""
    for child in atomic.children:
        if child.name == original_name.encode():
            return child.function_type
    return None


def _warn_if_cpu_placed(name: str, functions: list[function_pb2.FunctionDef], lists: OpLists, enablement: Any) -> None:
    """float16 converts GPU or unplaced nodes only (spec §1.5): a trace whose allow-list ops are
    all placed on a CPU — as MirroredStrategy on CPUs places them — runs in float32. Say so once."""
    placed = [node for function in functions for node in function.node_def if node.op in lists.allow]
    if placed and all("CPU" in node.device.upper() for node in placed) and enablement.show_once("cpu-float16"):
        warnings.warn(
            f"amp_rewrite: float16 rewrites GPU or unplaced nodes only, and {name}'s {placed[0].op} ops are placed on"
            " a CPU (as MirroredStrategy on CPUs places them), so it runs in float32; use target='bfloat16' on"
            " CPUs. (Shown once while enabled.)", stacklevel=3)
