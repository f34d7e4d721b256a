"""Live rewrite: from ``enable_mixed_precision_graph_rewrite`` on, every traced tf.function runs rewritten.

What enabling changes belongs to objects. Each ``enable_mixed_precision_graph_rewrite(...)``
and each ``mixed_precision()`` block makes an ``Enablement``, which owns its settings, its
once-only warnings and (FP8 training) the wrapper's ``Float8State``; the wrapper holds its
enablement. One process-wide ``Installer`` (``INSTALLER``) installs TensorFlow's hooks — the
trace callback and FuncGraph transform (``tracing``), the Session ``__init__`` patch
(``session``) and TensorFlow's "graph rewrite enabled" flag — while at least one enablement is
active, and puts each back exactly when the last one goes. New traces use the most recently
enabled active settings. Functions traced before enabling keep their old bodies; a
``tf.compat.v1.Session`` created while the rewrite is on runs a rewritten copy of its graph.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import tensorflow as tf

from amp_rewrite import _tf
from amp_rewrite.core.float8 import inference as core_float8
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.target import lookup_target
from amp_rewrite.training import float8, optimizers, session, tracing
from amp_rewrite.training.float8_state import DEFAULT_AMAX_HISTORY_LENGTH, Float8State, check_history_length

log = logging.getLogger(__name__)

MIN_COMPUTE_CAPABILITY = (7, 0)
FLOAT8 = "float8"  # FP8 training (training/float8.py), on a base precision
AMX_BF16_FLAG = "amx_bf16"  # the CPU flag of AMX's bfloat16 tiles, where bfloat16 pays
BF16_CPU_FLAGS = ("avx512_bf16", AMX_BF16_FLAG)
XLA_REWRITE_MIN_TENSORFLOW = tracing.XLA_REWRITE_MIN_TENSORFLOW
compat_name = tracing.compat_name


@dataclass(frozen=True)
class LiveRewrite:
    """What new traces are rewritten with."""

    target: str  # the precision painted: for FP8 training, the base precision around the float8 matmuls
    lists: OpLists
    cross_function: bool = False
    float8: float8.Float8Training | None = None  # FP8 training (target="float8"): its state
    timing_cache: Path | None = field(default=None, compare=False)  # read at each trace: its keeps join the lists

    @property
    def name(self) -> str:
        """The target as the user named it: ``"float8"`` for FP8 training."""
        return FLOAT8 if self.float8 is not None else self.target


@dataclass(eq=False)
class Enablement:
    """One ``enable_mixed_precision_graph_rewrite`` or ``mixed_precision`` block: its settings and
    the warnings it has shown once. ``disable()`` undoes exactly what it added."""

    settings: LiveRewrite
    shown: set[str] = field(default_factory=set)

    def show_once(self, key: str) -> bool:
        """True the first time ``key`` is asked for: show that warning (once per enablement)."""
        if key in self.shown:
            return False
        self.shown.add(key)
        return True

    @property
    def active(self) -> bool:
        return self in INSTALLER.active()

    def disable(self) -> bool:
        """Stop this enablement; False if it was not active. The hooks go when the last one does."""
        return INSTALLER.remove(self)


class Installer:
    """TensorFlow's process-wide hooks, installed while at least one enablement is active.

    Adding the first enablement installs them; removing the last one puts each back as it was
    found. Sessions created while one was active keep running their mirrors."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._active: list[Enablement] = []
        self._restore: list[Callable[[], None]] = []

    def active(self) -> tuple[Enablement, ...]:
        """The active enablements, oldest first."""
        with self.lock:
            return tuple(self._active)

    def current(self) -> Enablement | None:
        """The most recently enabled active enablement: new traces use its settings."""
        with self.lock:
            return self._active[-1] if self._active else None

    def add(self, enablement: Enablement) -> None:
        with self.lock:
            if not self._active:
                self._restore = _install()
            self._active.append(enablement)

    def remove(self, enablement: Enablement) -> bool:
        with self.lock:
            if enablement not in self._active:
                return False
            self._active.remove(enablement)
            if not self._active:
                _undo(self._restore)
            return True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No enablement is current inside the block (the hooks see the rewrite off), for a trace
        that is rewritten otherwise (the training doctor's replay); this thread holds the lock."""
        with self.lock:
            active, self._active = self._active, []
            try:
                yield
            finally:
                self._active = active

    def remove_all(self) -> None:
        with self.lock:
            while self._active:
                self.remove(self._active[-1])


INSTALLER = Installer()


def _float8_states() -> list[Float8State]:
    """The active enablements' FP8 states, newest last (``float8.prepare_trace``'s owners)."""
    return [e.settings.float8.state for e in INSTALLER.active() if e.settings.float8 is not None]


def _on_new_function(concrete_function: Any) -> None:
    tracing.on_new_function(concrete_function, INSTALLER.current())


def _on_new_graph(func_graph: Any) -> None:
    tracing.on_new_graph(func_graph, INSTALLER.current(), _float8_states())


def _session_settings() -> tuple[LiveRewrite, Callable[[str], bool]] | None:
    """What a Session created now runs its mirror with: the current settings and their once-only warnings."""
    enablement = INSTALLER.current()
    return None if enablement is None else (enablement.settings, enablement.show_once)


def _install() -> list[Callable[[], None]]:
    """Install the live rewrite's hooks; returns what undoes each, in order. A hook that fails to
    install leaves none of them installed."""
    restore: list[Callable[[], None]] = []
    installed = False
    try:
        flag = _tf.GRAPH_REWRITE_ENABLED.get()()
        # The flag makes tf_keras refuse a mixed policy; the Sessions it would turn grappler's own
        # AMP on in run our rewrite instead (session.py).
        _tf.SET_GRAPH_REWRITE_ENABLED.get()(True)
        restore.append(lambda: _tf.SET_GRAPH_REWRITE_ENABLED.get()(flag))
        for hooks, hook in ((_tf.CONCRETE_FUNCTION_CALLBACKS.get(), _on_new_function),
                            (_tf.FUNC_GRAPH_TRANSFORMS.get(), _on_new_graph)):
            hooks.append(hook)
            restore.append(lambda hooks=hooks, hook=hook: hooks.remove(hook))
        restore.append(session.patch_session_init(_session_settings))
        installed = True
    finally:
        if not installed:
            _undo(restore)
    return restore


def _undo(restore: list[Callable[[], None]]) -> None:
    while restore:
        restore.pop()()


def active() -> LiveRewrite | None:
    """The live rewrite in force (the most recent active enablement's settings), or None."""
    enablement = INSTALLER.current()
    return None if enablement is None else enablement.settings


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


def untimed_slowdown(target: str) -> str | None:
    """Where the op lists are known to lose to float32 on this machine, and nothing timed the
    result: why, in words (``convert`` without ``--tune`` says it); None where they are not.
    bfloat16 pays on a CPU with AMX; with AVX512-BF16 alone (or neither) its matmuls and
    convolutions are often slower than float32's, and the casts add to it. float16 pays on a
    GPU; on a CPU its kernels are float32 ones with conversions around them."""
    if target == "bfloat16" and AMX_BF16_FLAG not in cpu_flags():
        return "bfloat16 on a CPU without AMX is often slower than float32"
    if target == "float16" and not tf.config.list_physical_devices("GPU"):
        return f"{target} on a CPU (TensorFlow sees no GPU here) is often slower than float32"
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where there is none."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def target_name(target: Any) -> Any:
    """``tf.float16``/``tf.bfloat16`` (or a NumPy dtype) as the target's name; other values unchanged,
    for ``lookup_target`` to refuse with the names to use."""
    if isinstance(target, str) or target is None:
        return target
    try:
        return tf.as_dtype(target).name
    except TypeError:
        return target


def _require(target: Any) -> None:
    """Refuse in one line, before anything is installed, where a private TensorFlow name a
    feature enabling starts is gone (``_tf``)."""
    for feature in (_tf.LIVE, _tf.SESSION, _tf.OPTIMIZERS) + ((_tf.FLOAT8_TRAINING,) if target_name(target) == FLOAT8
                                                              else ()):
        _tf.require(feature)


def start(target: Any, lists: Any = None, cross_function: bool = False, *,
          amax_history_length: Any = None, base_precision: Any = "bfloat16", timing_cache: Any = None,
          keep: Any = ()) -> Enablement | None:
    """Rewrite every new trace from now on (no optimizer); returns the enablement, or None if it stays off."""
    _require(target)
    settings = plan_settings(target, lists, cross_function, amax_history_length=amax_history_length,
                             base_precision=base_precision, timing_cache=timing_cache, keep=keep)
    if settings is None:
        return None
    enablement = Enablement(settings)
    INSTALLER.add(enablement)
    return enablement


@dataclass(frozen=True)
class _Lists:
    """What the user gave for the lists: an overlay (file or ``OpLists``) and keep_nodes entries."""

    overlay: Any
    keep: tuple[str, ...]

    def load(self, target: str) -> OpLists:
        lists = load_lists(target, self.overlay)
        return lists.keeping(dict.fromkeys(self.keep, "")) if self.keep else lists


def keep_entries(keep: Any) -> tuple[str, ...]:
    """``keep=`` as keep_nodes entries: one regex (a string) or several; ``FUNCTION::REGEX`` for one
    function, as the CLI's ``--keep`` and an overlay's ``keep_nodes`` take them."""
    entries = (keep,) if isinstance(keep, str) else tuple(keep) if keep is not None else ()
    wrong = [entry for entry in entries if not isinstance(entry, str) or not entry]
    if wrong:
        raise ValueError(f"keep= takes node-name regexes (strings), got {wrong[0]!r}; e.g."
                         " keep=[\"model/dense_1/MatMul\", \".*/softmax/.*\"]")
    return entries


def plan_settings(target: Any, lists: Any = None, cross_function: bool = False, *,
                  amax_history_length: Any = None, base_precision: Any = "bfloat16",
                  float8_state: Float8State | None = None, timing_cache: Any = None,
                  keep: Any = ()) -> LiveRewrite | None:
    """The settings ``start`` would enable, every argument checked; nothing is changed yet.
    ``lists``: an overlay file or loaded ``OpLists``; ``keep``: node regexes kept float32 on top
    of them (``keep_entries``), as the CLI's ``--lists`` and ``--keep``.
    ``amax_history_length`` None: ``float8_state``'s (a resumed wrapper's), else Keras' 1024.
    ``timing_cache``: a ``convert --tune speed`` timing cache file, read (never timed into) at each trace."""
    policy = tracing.mixed_keras_policy()
    if policy:
        raise ValueError(
            f"The mixed precision graph rewrite cannot be enabled while the global Keras dtype policy is"
            f" {policy!r}: the two must not be combined. Call keras.config.set_dtype_policy('float32') first,"
            " or use the Keras policy alone."
        )
    if target_name(target) == FLOAT8:
        if timing_cache is not None:
            raise ValueError("timing_cache applies to target='bfloat16' or 'float16', not to FP8 training; leave it out")
        return _plan_float8(_Lists(lists, keep_entries(keep)), cross_function, amax_history_length, base_precision,
                            float8_state)
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
    _refuse_switch(target, None)
    return LiveRewrite(target, _Lists(lists, keep_entries(keep)).load(target), cross_function,
                       timing_cache=Path(timing_cache) if timing_cache is not None else None)


def _plan_float8(lists: _Lists, cross_function: bool, amax_history_length: Any, base_precision: Any,
                 float8_state: Float8State | None) -> LiveRewrite:
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
    _refuse_switch(FLOAT8, base)
    state = float8_state if float8_state is not None else Float8State(length)
    return LiveRewrite(base, lists.load(base), cross_function, float8.Float8Training(state))


def _refuse_switch(target: str, base: str | None) -> None:
    """FP8 training and another target do not take turns while enabled (the traces of one would
    run beside an optimizer wrapper and state made for the other), nor do two base precisions."""
    for enablement in INSTALLER.active():
        before = enablement.settings
        if FLOAT8 in (target, before.name) and before.name != target:
            raise ValueError(f"amp_rewrite: the rewrite is enabled for target {before.name!r} (its optimizer wrapper is"
                             f" in use); call amp_rewrite.disable_mixed_precision_graph_rewrite() before enabling"
                             f" {target!r}")
        if target == FLOAT8 and before.target != base:
            raise ValueError(f"amp_rewrite: FP8 training is enabled on base_precision {before.target!r}; every float8"
                             f" wrapper in use trains on one base: pass base_precision={before.target!r}, or disable"
                             " the other first")


def stop() -> None:
    """Every enablement stops: new traces are no longer rewritten (functions already rewritten stay
    so); everything the rewrite installed is put back."""
    INSTALLER.remove_all()


class _DefaultLossScale:
    """``loss_scale``'s default, by target: none for bfloat16 (float32's exponent range) — a scale
    of 1 that still skips non-finite steps — and ``"dynamic"`` for float16."""

    def __repr__(self) -> str:
        return "'dynamic' for float16 (and float8 on float16), else 1 (fixed, skipping non-finite steps)"


DEFAULT_LOSS_SCALE = _DefaultLossScale()


def default_loss_scale(settings: LiveRewrite | None) -> str | None:
    """``DEFAULT_LOSS_SCALE`` for ``settings``: only float16 gradients underflow without a scale."""
    return "dynamic" if settings is not None and settings.target == "float16" else None


def enable_mixed_precision_graph_rewrite(opt: Any, loss_scale: Any = DEFAULT_LOSS_SCALE, target: Any = None, *,
                                         cross_function: bool = False,
                                         amax_history_length: int | None = None,
                                         base_precision: str = "bfloat16", timing_cache: Any = None,
                                         lists: Any = None, keep: Any = ()) -> Any:
    """Wrap ``opt`` in its family's loss-scale optimizer and rewrite every tf.function traced from now on.

    ``opt``: a Keras 3, tf_keras or ``tf.compat.v1.train`` optimizer. ``loss_scale``: by default
    ``"dynamic"`` for float16 (2**15, ×2 after 2000 finite steps, ÷2 and skip on a non-finite
    step) and none for bfloat16 (a fixed scale of 1 that still skips non-finite steps, so a plain
    ``tape.gradient(loss)``/``apply_gradients`` loop works); or ``"dynamic"``, a number (fixed), a
    ``tf.compat.v1.mixed_precision.DynamicLossScale``/``FixedLossScale``, or None (1). ``target``:
    ``"float16"``, ``"bfloat16"`` (or ``tf.float16``/``tf.bfloat16``), ``"float8"`` (FP8 training:
    the matmuls on float8, the rest in ``base_precision``, ``"bfloat16"`` or ``"float16"``, with
    delayed scaling over ``amax_history_length`` steps (default 1024); the state is the returned
    wrapper's ``float8_state``), or None to pick float16 or bfloat16 from the hardware (the
    rewrite stays off, with a warning, when neither fits). ``cross_function``: paint across call
    and loop boundaries (``rewrite_graph_def``'s option). ``timing_cache``: the path of a timing
    cache that ``amp-rewrite convert --tune speed`` filled on this machine; each trace then
    keeps float32 what it says runs slower in the target, at the trace's shapes, timing nothing.
    ``lists``: an overlay file (as ``amp-rewrite convert --lists``) or loaded ``OpLists``; ``keep``:
    node-name regexes (``re.fullmatch``; ``FUNCTION::REGEX`` for one function) kept float32, as
    ``--keep`` — what the training doctor suggests pasting here.

    Enabling again keeps the earlier enablements: new traces use the newest one's settings (with a
    warning when its target differs); float8 and another target are an error. A wrapper this
    function returned (``model.optimizer`` after ``keras.models.load_model``, too) may be passed
    back with its target: it is enabled again with its state and returned as it is.
    """
    _require(target)
    resumed = optimizers.resumable(opt)
    if resumed is not None:
        return _resume(opt, resumed, loss_scale, target, cross_function=cross_function,
                       amax_history_length=amax_history_length, base_precision=base_precision,
                       timing_cache=timing_cache, lists=lists, keep=keep)
    settings = plan_settings(target, lists, cross_function=cross_function, amax_history_length=amax_history_length,
                             base_precision=base_precision, timing_cache=timing_cache, keep=keep)
    training = settings.float8 if settings is not None else None
    if loss_scale is DEFAULT_LOSS_SCALE:
        loss_scale = default_loss_scale(settings)
    made_for = (optimizers.MadeFor(settings.name, settings.target if training is not None else None)
                if settings is not None else None)
    wrapped = optimizers.wrap_optimizer(
        opt, loss_scale, float8_amax_history_length=training.amax_history_length if training else None,
        made_for=made_for)
    if training is not None:  # the wrapper made the state it tracks
        settings = LiveRewrite(settings.target, settings.lists, settings.cross_function,
                               float8.Float8Training(optimizers.float8_state_of(wrapped)))
    return _enable(wrapped, settings)


def _resume(opt: Any, made_for: optimizers.MadeFor, loss_scale: Any, target: Any, *, cross_function: bool,
            amax_history_length: Any, base_precision: Any, timing_cache: Any, lists: Any, keep: Any) -> Any:
    """Enable again for a wrapper of ours (``optimizers.resumable``), with its own state and loss scale."""
    if loss_scale is not DEFAULT_LOSS_SCALE:
        raise ValueError(f"this {type(opt).__name__} is already amp_rewrite's loss-scale optimizer, with its own loss"
                         " scale; leave loss_scale out to resume with it")
    asked = target_name(target) if target is not None else made_for.target
    base = target_name(base_precision) if asked == FLOAT8 else None
    if asked != made_for.target or made_for.base_precision not in (None, base):
        wanted = f"target={made_for.target!r}" + (f", base_precision={made_for.base_precision!r}"
                                                  if made_for.base_precision else "")
        raise ValueError(f"this {type(opt).__name__} was made for {wanted}, and its loss scale and state for that;"
                         f" pass {wanted} to resume with it, or wrap a new optimizer for another target")
    settings = plan_settings(asked, lists, cross_function=cross_function, amax_history_length=amax_history_length,
                             base_precision=base_precision, float8_state=optimizers.float8_state_of(opt),
                             timing_cache=timing_cache, keep=keep)
    earlier = optimizers.enablement_of(opt)
    if earlier is not None:
        earlier.disable()
    return _enable(opt, settings)


def _enable(wrapped: Any, settings: LiveRewrite | None) -> Any:
    """Start an enablement of ``settings`` held by ``wrapped``; warn where its target differs from the one in force."""
    if settings is None:
        return wrapped
    before = active()
    enablement = Enablement(settings)
    INSTALLER.add(enablement)
    optimizers.hold(wrapped, enablement)
    if before is not None and settings.target != before.target:
        warnings.warn(
            f"amp_rewrite: the rewrite was enabled for {before.target} and is now enabled for {settings.target}:"
            f" functions traced from now on are rewritten to {settings.target}, those traced before keep"
            f" {before.target}; call disable_mixed_precision_graph_rewrite() first to switch without this warning",
            stacklevel=3)
    return wrapped


def disable_mixed_precision_graph_rewrite(opt: Any = None) -> None:
    """Stop rewriting new traces; optimizers already wrapped stay wrapped. ``opt``: a wrapper that
    ``enable_mixed_precision_graph_rewrite`` returned, to stop only its enablement (the others stay)."""
    if opt is None:
        if not INSTALLER.active():
            warnings.warn("amp_rewrite: disable_mixed_precision_graph_rewrite() called, but the rewrite is not"
                          " enabled", stacklevel=2)
        stop()
        return
    enablement = optimizers.enablement_of(opt)
    if enablement is None or not enablement.disable():
        warnings.warn(f"amp_rewrite: disable_mixed_precision_graph_rewrite(opt) called, but this {type(opt).__name__}"
                      " has no enabled rewrite (it was disabled already, or enable_mixed_precision_graph_rewrite did"
                      " not return it)", stacklevel=2)


@contextlib.contextmanager
def mixed_precision(target: str | None = None, lists: Any = None, cross_function: bool = False,
                    amax_history_length: int | None = None, base_precision: str = "bfloat16",
                    timing_cache: Any = None, *, keep: Any = ()) -> Iterator[LiveRewrite | None]:
    """Rewrite the tf.functions traced inside the block (no optimizer wrapping). With
    ``target="float8"`` the yielded settings' ``float8.state`` holds the block's FP8 state:
    checkpoint it yourself. ``timing_cache``, ``lists``, ``keep``: as ``enable_mixed_precision_graph_rewrite``'s."""
    enablement = start(target, lists, cross_function, amax_history_length=amax_history_length,
                       base_precision=base_precision, timing_cache=timing_cache, keep=keep)
    try:
        yield enablement.settings if enablement is not None else None
    finally:
        if enablement is not None:
            enablement.disable()
