"""Live rewrite: from ``enable_mixed_precision_graph_rewrite`` on, every traced tf.function runs rewritten.

TensorFlow calls ``CONCRETE_FUNCTION_CALLBACKS`` with each new ConcreteFunction, after its
FunctionDef is registered in the eager context and before its first call. The callback
rewrites that FunctionDef and the library functions it calls (loop bodies, branches,
nested calls) and registers the rewritten ones under the same names, so every call —
custom training loops, ``model.fit``/``evaluate``/``predict``, and ``jit_compile=True``
functions, which XLA compiles from the registered body — runs them. Functions traced
before enabling keep their old bodies. A ``tf.compat.v1.Session`` created while the
rewrite is on runs a rewritten copy of its graph instead (``session``). What enabling
changes in the process is held by one ``LiveState``, which disabling puts back.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import keras
import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import atomic_function, transform
from tensorflow.python.training.experimental import mixed_precision_global_state

from amp_rewrite.training import float8, optimizers, session
from amp_rewrite.core import functions
from amp_rewrite.core import float8 as core_float8
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.rewrite import rewrite_graph_def
from amp_rewrite.core.target import lookup_target
from amp_rewrite.training.float8_state import DEFAULT_AMAX_HISTORY_LENGTH, Float8State, check_history_length

log = logging.getLogger(__name__)

MIN_COMPUTE_CAPABILITY = (7, 0)
FLOAT8 = "float8"  # FP8 training (training/float8.py), on a base precision
# The first TensorFlow release whose XLA compiles the FunctionDef registered under a
# jit_compile=True function's name when it is called on its own; older ones compile the
# body as traced (it still works for one called from another function, as Keras' steps
# are), so there the rewrite warns (tools/matrix.py, tests/test_live.py).
XLA_REWRITE_MIN_TENSORFLOW = (2, 18)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class LiveRewrite:
    """What new traces are rewritten with."""

    target: str  # the precision painted: for FP8 training, the base precision around the float8 matmuls
    lists: OpLists
    cross_function: bool = False
    float8: float8.Float8Training | None = None  # FP8 training (target="float8"): its state

    @property
    def name(self) -> str:
        """The target as the user named it: ``"float8"`` for FP8 training."""
        return "float8" if self.float8 is not None else self.target


@dataclass
class LiveState:
    """Everything the live rewrite changes in this process, and how to put it back.

    The first ``enable`` installs four things — the trace callback, the FuncGraph transform
    that prepares FP8 training's state (``float8.prepare_trace``), the Session ``__init__``
    patch (``session.patch_session_init``) and TensorFlow's "graph rewrite enabled" flag —
    and ``disable`` restores each as it found it. Sessions created while it
    was on keep running their mirrors. A warning shown once is shown once per enabling.
    """

    settings: LiveRewrite | None = None
    shown: set[str] = field(default_factory=set)  # the once-only warnings already shown
    _restore: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def enable(self, settings: LiveRewrite) -> None:
        if not self._restore:
            self._restore = _install()
        self.settings = settings

    def disable(self) -> None:
        while self._restore:
            self._restore.pop()()
        self.settings = None
        self.shown.clear()

    def show_once(self, key: str) -> bool:
        """True the first time ``key`` is asked for while enabled: show that warning."""
        if key in self.shown:
            return False
        self.shown.add(key)
        return True


def _install() -> list[Callable[[], None]]:
    """Install the live rewrite's hooks; returns what undoes each, in order."""
    flag = mixed_precision_global_state.is_mixed_precision_graph_rewrite_enabled()
    # The flag makes tf_keras refuse a mixed policy; the Sessions it would turn grappler's own
    # AMP on in run our rewrite instead (session.py).
    mixed_precision_global_state.set_mixed_precision_graph_rewrite_enabled(True)
    transform.CONCRETE_FUNCTION_CALLBACKS.append(_on_new_function)
    transform.FUNC_GRAPH_TRANSFORMS.append(_on_new_graph)
    restore_session_init = session.patch_session_init(active, lambda key: STATE.show_once(key))
    return [lambda: mixed_precision_global_state.set_mixed_precision_graph_rewrite_enabled(flag),
            lambda: transform.CONCRETE_FUNCTION_CALLBACKS.remove(_on_new_function),
            lambda: transform.FUNC_GRAPH_TRANSFORMS.remove(_on_new_graph),
            restore_session_init]


STATE = LiveState()


def active() -> LiveRewrite | None:
    """The live rewrite in force, or None."""
    return STATE.settings


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
    flags = cpu_flags()
    if any(flag in flags for flag in BF16_CPU_FLAGS):
        return "bfloat16", "the CPU has " + " and ".join(f for f in BF16_CPU_FLAGS if f in flags)
    return None, "no GPU of compute capability 7.0+ and the CPU has neither AVX512-BF16 nor AMX"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where there is none."""
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


def target_name(target: Any) -> Any:
    """``tf.float16``/``tf.bfloat16`` (or a NumPy dtype) as the target's name; other values unchanged,
    for ``lookup_target`` to refuse with the names to use."""
    if isinstance(target, str) or target is None:
        return target
    try:
        return tf.as_dtype(target).name
    except TypeError:
        return target


def start(target: Any, lists: Any = None, cross_function: bool = False, *,
          amax_history_length: Any = None, base_precision: Any = "bfloat16",
          float8_state: Float8State | None = None) -> LiveRewrite | None:
    """Rewrite every new trace from now on; returns the settings, or None if it stays off."""
    settings = plan_settings(target, lists, cross_function, amax_history_length=amax_history_length,
                             base_precision=base_precision, float8_state=float8_state)
    if settings is not None:
        STATE.enable(settings)
    return settings


def plan_settings(target: Any, lists: Any = None, cross_function: bool = False, *,
                  amax_history_length: Any = None, base_precision: Any = "bfloat16",
                  float8_state: Float8State | None = None) -> LiveRewrite | None:
    """The settings ``start`` would enable, every argument checked; nothing is changed yet.
    ``amax_history_length`` None: ``float8_state``'s (a resumed wrapper's), else Keras' 1024."""
    policy = _mixed_keras_policy()
    if policy:
        raise ValueError(
            f"The mixed precision graph rewrite cannot be enabled while the global Keras dtype policy is"
            f" {policy!r}: the two must not be combined. Call keras.config.set_dtype_policy('float32') first,"
            " or use the Keras policy alone."
        )
    if target_name(target) == FLOAT8:
        core_float8.check_tensorflow()
        base = target_name(base_precision)
        if base not in float8.BASE_PRECISIONS:
            raise ValueError(f"base_precision must be one of {', '.join(map(repr, float8.BASE_PRECISIONS))} (the"
                             f" precision around the float8 matmuls), got {base_precision!r}")
        if amax_history_length is None:
            amax_history_length = (float8_state.amax_history_length if float8_state is not None
                                   else DEFAULT_AMAX_HISTORY_LENGTH)
        length = check_history_length(amax_history_length)
        if float8_state is not None and float8_state.amax_history_length != length:
            raise ValueError(f"this optimizer's float8 state keeps amax histories of {float8_state.amax_history_length}"
                             f" steps; pass amax_history_length={float8_state.amax_history_length}")
        _refuse_switch(FLOAT8)
        state = float8_state if float8_state is not None else Float8State(length)
        return LiveRewrite(base, load_lists(base, lists), cross_function, float8.Float8Training(state))
    if (amax_history_length, base_precision) != (None, "bfloat16"):
        raise ValueError(f"amax_history_length and base_precision apply to target='float8', not {target!r};"
                         " leave them out")
    if target is None:
        target, why = detect_target()
        if target is None:
            warnings.warn(f"amp_rewrite: mixed precision graph rewrite stays off: {why}; pass target= to force one",
                          stacklevel=4)
            return None
        log.info("amp_rewrite: rewriting to %s (%s)", target, why)
    else:
        target = lookup_target(target_name(target)).name  # None above: detect it
    _refuse_switch(target)
    return LiveRewrite(target, load_lists(target, lists), cross_function)


def _refuse_switch(target: str) -> None:
    """FP8 training and another target do not take turns while enabled: the traces of one would
    run beside an optimizer wrapper (and state) made for the other."""
    before = STATE.settings
    if before is not None and FLOAT8 in (target, before.name) and before.name != target:
        raise ValueError(f"amp_rewrite: the rewrite is enabled for target {before.name!r} (its optimizer wrapper is in"
                         f" use); call amp_rewrite.disable_mixed_precision_graph_rewrite() before enabling {target!r}")


def stop() -> None:
    """New traces are no longer rewritten (functions already rewritten stay so); everything the
    rewrite installed is put back."""
    STATE.disable()


class _DefaultLossScale:
    """``loss_scale``'s default: ``"dynamic"``, except no scaling for FP8 training on bfloat16,
    whose delayed scales already follow the gradients (a loss scale's ×2 steps would only clip them)."""

    def __repr__(self) -> str:
        return "'dynamic' (None for target='float8' on bfloat16)"


DEFAULT_LOSS_SCALE = _DefaultLossScale()


def enable_mixed_precision_graph_rewrite(opt: Any, loss_scale: Any = DEFAULT_LOSS_SCALE, target: Any = None,
                                         cross_function: bool = False,
                                         amax_history_length: int | None = None,
                                         base_precision: str = "bfloat16") -> Any:
    """Wrap ``opt`` in its family's loss-scale optimizer and rewrite every tf.function traced from now on.

    ``opt``: a Keras 3, tf_keras or ``tf.compat.v1.train`` optimizer. ``loss_scale``:
    ``"dynamic"`` (the default: 2**15, ×2 after 2000 finite steps, ÷2 and skip on a non-finite
    step), a number (fixed), a ``tf.compat.v1.mixed_precision.DynamicLossScale``/``FixedLossScale``,
    or None (no scaling; fine for bfloat16). ``target``: ``"float16"``, ``"bfloat16"`` (or
    ``tf.float16``/``tf.bfloat16``), ``"float8"`` (FP8 training: the matmuls on float8, the rest
    in ``base_precision``, ``"bfloat16"`` (no loss scaling by default) or ``"float16"``, with
    delayed scaling over ``amax_history_length`` steps (default 1024); the state is tracked by the returned
    wrapper as ``float8_state``), or None to pick float16 or bfloat16 from the hardware (the
    rewrite stays off, with a warning, when neither fits). Enabling again with another target
    warns; float8 and another target are an error. ``cross_function``: paint across call and
    loop boundaries (``rewrite_graph_def``'s option); the functions a trace calls are then
    rewritten into private copies of its own.

    A Keras 3 wrapper this function returned for float8 (``model.optimizer`` after
    ``keras.models.load_model``) may be passed back with ``target="float8"``: the rewrite is
    enabled with its state (and its ``amax_history_length``), and it is returned as it is.
    """
    resumed = optimizers.float8_state_of(opt) if target_name(target) == FLOAT8 else None
    if resumed is not None and loss_scale is not DEFAULT_LOSS_SCALE:
        raise ValueError(f"this {type(opt).__name__} is already amp_rewrite's float8 wrapper, with its own loss scale;"
                         " leave loss_scale out to resume with it")
    settings = plan_settings(target, cross_function=cross_function, amax_history_length=amax_history_length,
                             base_precision=base_precision, float8_state=resumed)
    training = settings.float8 if settings is not None else None
    if resumed is None:
        if loss_scale is DEFAULT_LOSS_SCALE:
            loss_scale = None if training is not None and settings.target == "bfloat16" else "dynamic"
        wrapped = optimizers.wrap_optimizer(
            opt, loss_scale, float8_amax_history_length=training.amax_history_length if training else None)
        if training is not None:  # the wrapper made the state it tracks
            settings = replace(settings, float8=float8.Float8Training(optimizers.float8_state_of(wrapped)))
    else:
        wrapped = opt
    before = STATE.settings
    if settings is not None:
        STATE.enable(settings)
    if before is not None and settings is not None and settings.target != before.target:
        warnings.warn(
            f"amp_rewrite: the rewrite was enabled for {before.target} and is now enabled for {settings.target}:"
            f" functions traced from now on are rewritten to {settings.target}, those traced before keep"
            f" {before.target}; call disable_mixed_precision_graph_rewrite() first to switch without this warning",
            stacklevel=2)
    return wrapped


def disable_mixed_precision_graph_rewrite() -> None:
    """Stop rewriting new traces; optimizers already wrapped stay wrapped."""
    if STATE.settings is None:
        warnings.warn("amp_rewrite: disable_mixed_precision_graph_rewrite() called, but the rewrite is not enabled",
                      stacklevel=2)
    stop()


@contextlib.contextmanager
def mixed_precision(target: str | None = None, lists: Any = None, cross_function: bool = False,
                    amax_history_length: int | None = None,
                    base_precision: str = "bfloat16") -> Iterator[LiveRewrite | None]:
    """Rewrite the tf.functions traced inside the block (no optimizer wrapping). With
    ``target="float8"`` the yielded settings' ``float8.state`` holds the block's FP8 state:
    checkpoint it yourself."""
    before = STATE.settings
    settings = start(target, lists, cross_function, amax_history_length=amax_history_length,
                     base_precision=base_precision)
    try:
        yield settings
    finally:
        if before is None:
            STATE.disable()
        else:
            STATE.enable(before)


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


def rewrite_registered_function(name: str, library: function_pb2.FunctionDefLibrary, settings: LiveRewrite,
                                atomic: Any = None, step: float8.TraceStep | None = None) -> tuple[int, int]:
    """Rewrite the registered function ``name`` in the eager context; its callees are rewritten
    into private copies (``private_copies``) that only the new ``name`` calls.

    Returns how many functions were registered and how many matmuls run on float8. The
    signature of ``name`` never changes. ``atomic``: ``name``'s AtomicFunction, whose children
    (the functions copied into a graph or SavedModel with it) gain the copies, which then live
    as long as it does. ``step``: FP8 training's findings in ``name``'s FuncGraph, for its float8 chains.
    """
    ctx = context.context()
    function = ctx.get_function_def(name)
    graph_def = _call_graph(function, library)
    result = rewrite_graph_def(graph_def, target=settings.target, fetches=["call"], lists=settings.lists,
                               cross_function=settings.cross_function, entry_functions=[name])
    if step is not None and settings.float8 is not None:
        result = float8.quantize(graph_def, result, name, step, settings.float8)
    original = {f.signature.name: f for f in graph_def.library.function}
    rewritten = {f.signature.name: f for f in result.graph_def.library.function}
    copies = private_copies(name, original, rewritten)
    copy_to_original = {private_name(f, name): f for f in rewritten}
    for copy in copies:
        copy_name = copy.signature.name
        if copy_name == name:
            ctx.remove_function(name)
            ctx.add_function_def(copy)
        elif not ctx.has_function(copy_name):
            ctx.add_function_def(copy)
            if atomic is not None:
                atomic.children.append(atomic_function.AtomicFunction(
                    copy_name, ctx, _child_type(atomic, copy_to_original[copy_name])))
    log.debug("amp_rewrite: %s: %s", name, result.report.summary())
    return len(copies), result.report.float8_matmuls


def _child_type(atomic: Any, original_name: str) -> Any:
    """The FunctionType of ``atomic``'s child ``original_name`` (a copy's dtypes may differ
    under cross_function; the type is kept only as the children's other entries have one)."""
    for child in atomic.children:
        if child.name == original_name.encode():
            return child.function_type
    return None


def compat_name(name: bytes | str) -> str:
    """A function name as ``str`` (TensorFlow hands out ``bytes`` and ``str``)."""
    return name.decode() if isinstance(name, bytes) else name


def _on_new_function(concrete_function: Any) -> None:
    settings = STATE.settings
    if settings is None:
        return
    if _mixed_keras_policy() and STATE.show_once("policy"):
        warnings.warn("amp_rewrite: a mixed precision Keras policy was set after enabling the graph rewrite;"
                      " the two must not be combined", stacklevel=2)
    function_def = concrete_function.function_def
    name = function_def.signature.name
    # ``in`` first: indexing the map would insert an empty attr into TensorFlow's cached
    # definition, which it copies onto call ops (model.export then fails to bind it).
    jit_compile = "_XlaMustCompile" in function_def.attr and function_def.attr["_XlaMustCompile"].b
    if jit_compile and tensorflow_version() < XLA_REWRITE_MIN_TENSORFLOW:
        warnings.warn(
            f"amp_rewrite: TensorFlow {tf.__version__} compiles a jit_compile=True function called on its own from"
            f" the body as traced, so {name} may run in float32; use TensorFlow"
            f" {'.'.join(map(str, XLA_REWRITE_MIN_TENSORFLOW))} or newer, or jit_compile=False", stacklevel=2)
    library = concrete_function.graph.as_graph_def().library
    step = float8.trace_step(concrete_function.graph) if settings.float8 is not None else None
    changed, float8_matmuls = rewrite_registered_function(
        name, library, settings, getattr(concrete_function, "_inference_function", None), step)
    if float8_matmuls and not (jit_compile or step.under_xla or float8.xla_jit_enabled()) \
            and STATE.show_once("float8-emulated"):
        warnings.warn(float8.emulated_warning(name, float8_matmuls), stacklevel=2)
    if not changed and settings.target == "float16" and "cpu-float16" not in STATE.shown:
        _warn_if_cpu_placed(name, [function_def, *library.function], settings.lists)


def _on_new_graph(func_graph: Any) -> None:
    """FP8 training's transform of each traced FuncGraph, before its FunctionDef exists."""
    settings = STATE.settings
    if settings is not None and settings.float8 is not None:
        float8.prepare_trace(func_graph, settings.target, settings.lists, settings.float8)


def _warn_if_cpu_placed(name: str, functions: list[function_pb2.FunctionDef], lists: OpLists) -> None:
    """float16 converts GPU or unplaced nodes only (spec §1.5): a trace whose allow-list ops are
    all placed on a CPU — as MirroredStrategy on CPUs places them — runs in float32. Say so once."""
    placed = [node for function in functions for node in function.node_def if node.op in lists.allow]
    if placed and all("CPU" in node.device.upper() for node in placed) and STATE.show_once("cpu-float16"):
        warnings.warn(
            f"amp_rewrite: float16 rewrites GPU or unplaced nodes only, and {name}'s {placed[0].op} ops are placed on"
            " a CPU (as MirroredStrategy on CPUs places them), so it runs in float32; use target='bfloat16' on"
            " CPUs. (Shown once while enabled.)", stacklevel=3)


def tensorflow_version() -> tuple[int, int]:
    """The installed TensorFlow's (major, minor)."""
    major, minor = tf.__version__.split(".")[:2]
    return int(major), int(minor)
