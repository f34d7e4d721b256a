"""Live rewrite: from ``enable_mixed_precision_graph_rewrite`` on, every traced tf.function runs rewritten.

TensorFlow calls ``CONCRETE_FUNCTION_CALLBACKS`` with each new ConcreteFunction, after its
FunctionDef is registered in the eager context and before its first call. The callback
rewrites that FunctionDef and the library functions it calls (loop bodies, branches,
nested calls) and registers the rewritten ones under the same names, so every call —
custom training loops, ``model.fit``/``evaluate``/``predict``, and ``jit_compile=True``
functions, which XLA compiles from the registered body — runs them. Functions traced
before enabling keep their old bodies.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import keras
import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import transform
from tensorflow.python.training.experimental import mixed_precision_global_state

from amp_rewrite.training import optimizers
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.rewrite import rewrite_graph_def
from amp_rewrite.core.target import lookup_target

log = logging.getLogger(__name__)

MIN_COMPUTE_CAPABILITY = (7, 0)
# The first TensorFlow release whose XLA compiles the FunctionDef registered under a
# jit_compile=True function's name when it is called on its own; older ones compile the
# body as traced (it still works for one called from another function, as Keras' steps
# are), so there the rewrite warns (tools/matrix.py, tests/test_live.py).
XLA_REWRITE_MIN_TENSORFLOW = (2, 18)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class LiveRewrite:
    """What new traces are rewritten with."""

    target: str
    lists: OpLists
    cross_function: bool = False


_active: LiveRewrite | None = None
_warned_policy = False


def active() -> LiveRewrite | None:
    """The live rewrite in force, or None."""
    return _active


def detect_target() -> tuple[str | None, str]:
    """``float16`` if every visible GPU has compute capability ≥ 7.0, ``bfloat16`` on a CPU
    with AVX512-BF16 or AMX, else None; with the reason, for the user."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        capabilities = [tf.config.experimental.get_device_details(g).get("compute_capability") for g in gpus]
        slow = [f"{g.name} ({c[0]}.{c[1]})" if c else g.name for g, c in zip(gpus, capabilities)
                if not c or tuple(c) < MIN_COMPUTE_CAPABILITY]
        if not slow:
            return "float16", f"{len(gpus)} GPU(s) of compute capability 7.0 or higher"
        return None, f"GPU(s) {', '.join(slow)} are below compute capability 7.0 and gain nothing from float16"
    flags = _cpu_flags()
    if any(flag in flags for flag in BF16_CPU_FLAGS):
        return "bfloat16", "the CPU has " + " and ".join(f for f in BF16_CPU_FLAGS if f in flags)
    return None, "no GPU of compute capability 7.0+ and the CPU has neither AVX512-BF16 nor AMX"


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _mixed_keras_policy() -> str | None:
    """The name of a global mixed-precision Keras policy (Keras 3 or tf_keras), if one is set."""
    if mixed_precision_global_state.is_using_mixed_precision_policy():
        return "a tf_keras mixed precision policy"
    name = keras.config.dtype_policy().name
    return name if name.startswith("mixed") else None


def start(target: str | None, lists: Any = None, cross_function: bool = False) -> LiveRewrite | None:
    """Rewrite every new trace from now on; returns the settings, or None if it stays off."""
    global _active
    policy = _mixed_keras_policy()
    if policy:
        raise ValueError(
            f"The mixed precision graph rewrite cannot be enabled while the global Keras dtype policy is"
            f" {policy!r}: the two must not be combined. Call keras.config.set_dtype_policy('float32') first,"
            " or use the Keras policy alone."
        )
    if target is None:
        target, why = detect_target()
        if target is None:
            warnings.warn(f"amp_rewrite: mixed precision graph rewrite stays off: {why}; pass target= to force one",
                          stacklevel=3)
            return None
        log.info("amp_rewrite: rewriting to %s (%s)", target, why)
    else:
        target = lookup_target(target).name  # None above: detect it
    _active = LiveRewrite(target, load_lists(target, lists), cross_function)
    mixed_precision_global_state.set_mixed_precision_graph_rewrite_enabled(True)
    if _on_new_function not in transform.CONCRETE_FUNCTION_CALLBACKS:
        transform.CONCRETE_FUNCTION_CALLBACKS.append(_on_new_function)
    return _active


def stop() -> None:
    """New traces are no longer rewritten (functions already rewritten stay so)."""
    global _active
    _active = None
    mixed_precision_global_state.set_mixed_precision_graph_rewrite_enabled(False)


def enable_mixed_precision_graph_rewrite(opt: Any, loss_scale: Any = "dynamic", target: str | None = None) -> Any:
    """Wrap ``opt`` in its family's loss-scale optimizer and rewrite every tf.function traced from now on.

    ``opt``: a Keras 3, tf_keras or ``tf.compat.v1.train`` optimizer. ``loss_scale``:
    ``"dynamic"`` (2**15, ×2 after 2000 finite steps, ÷2 and skip on a non-finite step), a
    number (fixed), a ``tf.compat.v1.mixed_precision.DynamicLossScale``/``FixedLossScale``,
    or None (no scaling; fine for bfloat16). ``target``: ``"float16"``, ``"bfloat16"``, or
    None to pick from the hardware (the rewrite stays off, with a warning, when neither fits).
    """
    wrapped = optimizers.wrap_optimizer(opt, loss_scale)
    start(target)
    return wrapped


def disable_mixed_precision_graph_rewrite() -> None:
    """Stop rewriting new traces; optimizers already wrapped stay wrapped."""
    if _active is None:
        warnings.warn("amp_rewrite: disable_mixed_precision_graph_rewrite() called, but the rewrite is not enabled",
                      stacklevel=2)
    stop()


@contextlib.contextmanager
def mixed_precision(target: str | None = None, lists: Any = None, cross_function: bool = False) -> Iterator[LiveRewrite | None]:
    """Rewrite the tf.functions traced inside the block (no optimizer wrapping)."""
    global _active
    before = _active
    settings = start(target, lists, cross_function)
    try:
        yield settings
    finally:
        _active = before
        mixed_precision_global_state.set_mixed_precision_graph_rewrite_enabled(before is not None)


def _call_graph(function: function_pb2.FunctionDef, library: function_pb2.FunctionDefLibrary) -> graph_pb2.GraphDef:
    """A graph whose only work is one call of ``function``: its body becomes a function item."""
    graph_def = graph_pb2.GraphDef()
    graph_def.library.CopyFrom(library)
    if function.signature.name not in {f.signature.name for f in library.function}:
        graph_def.library.function.add().CopyFrom(function)
    call = graph_def.node.add(name="call", op="StatefulPartitionedCall")
    for index, arg in enumerate(function.signature.input_arg):
        placeholder = graph_def.node.add(name=f"input_{index}", op="Placeholder")
        placeholder.attr["dtype"].type = arg.type
        call.input.append(placeholder.name)
    call.attr["f"].func.name = function.signature.name
    call.attr["Tin"].list.type.extend(a.type for a in function.signature.input_arg)
    call.attr["Tout"].list.type.extend(a.type for a in function.signature.output_arg)
    for name in ("config", "config_proto", "executor_type"):
        call.attr[name].s = b""
    return graph_def


def rewrite_registered_function(name: str, library: function_pb2.FunctionDefLibrary, settings: LiveRewrite) -> int:
    """Rewrite the registered function ``name`` and its callees in the eager context.

    Returns how many functions were replaced. The signature of ``name`` never changes.
    """
    ctx = context.context()
    function = ctx.get_function_def(name)
    graph_def = _call_graph(function, library)
    result = rewrite_graph_def(graph_def, target=settings.target, fetches=["call"], lists=settings.lists,
                               cross_function=settings.cross_function, entry_functions=[name])
    original = {f.signature.name: f for f in graph_def.library.function}
    replaced = 0
    for rewritten in result.graph_def.library.function:
        function_name = rewritten.signature.name
        if rewritten == original[function_name]:
            continue
        if ctx.has_function(function_name):
            ctx.remove_function(function_name)
        ctx.add_function_def(rewritten)
        replaced += 1
    log.debug("amp_rewrite: %s: %s", name, result.report.summary())
    return replaced


def _on_new_function(concrete_function: Any) -> None:
    global _warned_policy
    settings = _active
    if settings is None:
        return
    if not _warned_policy and _mixed_keras_policy():
        _warned_policy = True
        warnings.warn("amp_rewrite: a mixed precision Keras policy was set after enabling the graph rewrite;"
                      " the two must not be combined", stacklevel=2)
    function_def = concrete_function.function_def
    name = function_def.signature.name
    if function_def.attr["_XlaMustCompile"].b and tensorflow_version() < XLA_REWRITE_MIN_TENSORFLOW:
        warnings.warn(
            f"amp_rewrite: TensorFlow {tf.__version__} compiles a jit_compile=True function called on its own from"
            f" the body as traced, so {name} may run in float32; use TensorFlow"
            f" {'.'.join(map(str, XLA_REWRITE_MIN_TENSORFLOW))} or newer, or jit_compile=False", stacklevel=2)
    library = concrete_function.graph.as_graph_def().library
    rewrite_registered_function(name, library, settings)


def tensorflow_version() -> tuple[int, int]:
    """The installed TensorFlow's (major, minor)."""
    major, minor = tf.__version__.split(".")[:2]
    return int(major), int(minor)
