"""The Session path: a ``tf.compat.v1.Session`` created while the rewrite is on runs our rewrite.

TensorFlow's Session reads its graph from the C++ graph behind ``tf.Graph`` and extends
it run by run; there is no Python hook between the two, and a node a Session has run may
not change. So such a Session never runs the user's graph itself: it runs a private
*mirror* — ``rewrite_graph_def`` of the user's GraphDef (our lists, overlays, environment
variables, target), imported into a private ``tf.Graph`` with the same node names — in a
private Session with the same target and config.

The Session keeps every piece of ``BaseSession`` that reads fetches and feeds: TensorFlow's
own fetch mapper, feed expansion (sparse and composite placeholders), dtype and shape
checks. It swaps only the bottom layer, where those are flat lists of graph outputs and
operations about to reach the user's C session (``_call_tf_sessionrun``, partial runs,
``make_callable`` and ``_make_callable_from_options`` callables): there each one is mapped
by name onto the mirror, a fed value whose tensor the rewrite converted is cast to the
mirror's dtype, and a fetched one back to the user graph's. The user's own C session never
receives the graph.

The mirror only grows. When a run needs ops it lacks (an eval op, a Saver added after the
first run), the user's graph is rewritten again with the mirror's nodes *frozen*
(``rewrite_graph_def(frozen=)``: they keep the dtypes they run with, and the new ops are
painted around them) and only the new nodes are imported, so variables, iterator
positions, tables and queues live on. Where a new op would still change a node the mirror
runs (a TensorList shared with it, ``cross_function`` across a running function), the run
is refused with one line.

Grappler's own auto_mixed_precision is left off in every Session created while the
rewrite is on, unless the config turns it on explicitly: TensorFlow would switch it on
when the global "graph rewrite enabled" flag is set (``session.py``), which this package
sets only so that tf_keras refuses a mixed policy.
"""
from __future__ import annotations

import functools
import logging
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from amp_rewrite import _tf
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.rewrite import RewriteResult, rewrite_graph_def
from amp_rewrite.errors import AmpRewriteError
from amp_rewrite.training import float8

log = logging.getLogger(__name__)

MIRROR_GRAPH_ATTR = "_amp_rewrite_mirror_of"  # set on a mirror's tf.Graph: its Session runs it as it is


@dataclass
class Mirror:
    """The rewritten copy of one user graph that a private Session runs; it only grows."""

    graph: tf.Graph
    session: tf.compat.v1.Session
    result: RewriteResult  # the rewrite it runs: frozen for the next one
    sources: dict[str, node_def_pb2.NodeDef]  # the user's nodes that rewrite read, by name
    nodes: dict[str, node_def_pb2.NodeDef]  # as rewritten, by name
    functions: dict[str, function_pb2.FunctionDef]  # as rewritten, by name
    # Looked up once per tensor and op (a running node never changes): runs map every element.
    _outputs: dict[tuple[str, int], tuple[Any, tf.DType]] = field(default_factory=dict, repr=False)
    _operations: dict[str, Any] = field(default_factory=dict, repr=False)
    _fetches: dict[tuple[str, int], _Fetch] = field(default_factory=dict, repr=False)

    def output(self, name: str, index: int) -> tuple[Any, tf.DType]:
        """The mirror's output ``name:index`` (a TF_Output) and its dtype."""
        found = self._outputs.get((name, index))
        if found is None:
            tensor = self.graph.get_operation_by_name(name).outputs[index]
            found = self._outputs[name, index] = (_tf.TENSOR_AS_TF_OUTPUT.get()(tensor), tensor.dtype)
        return found

    def operation(self, name: str) -> Any:
        """The mirror's operation ``name`` (a TF_Operation)."""
        found = self._operations.get(name)
        if found is None:
            found = self._operations[name] = _tf.OPERATION_C_OP.get().__get__(self.graph.get_operation_by_name(name))
        return found

    def fetch(self, user_output: Any) -> _Fetch:
        """The mirror's output for the user graph's ``user_output`` (a TF_Output), and the dtype
        to return its value in where the rewrite changed it."""
        key = (_operation_name(user_output.oper), user_output.index)
        found = self._fetches.get(key)
        if found is None:
            inner, dtype = self.output(*key)
            user = _tf.OPERATION_OUTPUT_TYPE.get()(user_output)
            found = self._fetches[key] = _Fetch(
                inner, None if dtype.as_datatype_enum == user else tf.as_dtype(user).base_dtype.as_numpy_dtype)
        return found

    def feeds(self, feed_dict: dict) -> dict:
        """``feed_dict`` (user TF_Output -> value) for the mirror: a value whose tensor the rewrite
        converted is cast to the mirror's dtype."""
        feeds = {}
        for user_output, value in feed_dict.items():
            inner, dtype = self.output(_operation_name(user_output.oper), user_output.index)
            if dtype.as_numpy_dtype != value.dtype and value.dtype != object:  # object: a TensorHandle
                value = value.astype(dtype.as_numpy_dtype)
            feeds[inner] = value
        return feeds


def patch_session_init(settings: Callable[[], tuple[Any, Callable[[str], bool]] | None]) -> Callable[[], None]:
    """Make a Session created while ``settings()`` gives (a ``live.LiveRewrite``, its once-only
    warnings' ``show_once``) run the mirror; returns the function that puts ``BaseSession.__init__`` back."""
    _tf.require(_tf.SESSION)
    base_session = _tf.BASE_SESSION.get()
    original = base_session.__init__

    @functools.wraps(original)
    def __init__(self, target: str = "", graph: tf.Graph | None = None, config: Any = None) -> None:
        found = settings()
        if found is None or getattr(graph, MIRROR_GRAPH_ATTR, None) is not None:
            original(self, target, graph, config)
            return
        original(self, target, graph, _without_grappler_amp(config))
        self.__class__ = _mirrored_class(type(self))
        self._amp_rewrite_settings, self._amp_rewrite_show_once = found
        self._amp_rewrite_mirror = None
        self._amp_rewrite_lock = threading.Lock()

    base_session.__init__ = __init__

    def restore() -> None:
        if base_session.__init__ is __init__:  # else someone patched it after us: leave theirs
            base_session.__init__ = original

    return restore


def is_mirrored(session: Any) -> bool:
    """Whether ``session`` runs the rewritten mirror (it was created while the rewrite was on)."""
    return isinstance(session, MirroredSession)


def running_mirror(session: Any) -> tuple[Mirror, str] | None:
    """The mirror a mirrored ``session`` runs and its target, once a run has built it; else None."""
    mirror = getattr(session, "_amp_rewrite_mirror", None) if is_mirrored(session) else None
    return None if mirror is None else (mirror, session._amp_rewrite_settings.target)  # pylint: disable=protected-access


def _without_grappler_amp(config: Any) -> Any:
    """``config`` (or the default one) with grappler's AMP off, unless it is explicitly on."""
    if config is None:
        config = _default_config()
    if not isinstance(config, config_pb2.ConfigProto):
        return config  # BaseSession raises its own TypeError
    options = config.graph_options.rewrite_options
    if options.auto_mixed_precision == rewriter_config_pb2.RewriterConfig.ON:
        return config
    copy = config_pb2.ConfigProto()
    copy.CopyFrom(config)
    copy.graph_options.rewrite_options.auto_mixed_precision = rewriter_config_pb2.RewriterConfig.OFF
    return copy


def _default_config() -> config_pb2.ConfigProto:
    return _tf.SESSION_EAGER_CONTEXT.get()().config


_CLASS_TO_MIRRORED: dict[type, type] = {}


def _mirrored_class(cls: type) -> type:
    """``cls`` (Session, InteractiveSession, ...) with ``MirroredSession``'s methods first."""
    if cls not in _CLASS_TO_MIRRORED:
        _CLASS_TO_MIRRORED[cls] = type(cls.__name__, (MirroredSession, cls), {"__module__": cls.__module__})
    return _CLASS_TO_MIRRORED[cls]


@dataclass(frozen=True)
class _Fetch:
    """One fetched output of the mirror, and the user graph's dtype to return it in (None: the same)."""

    output: Any
    user_dtype: Any = None

    def to_user(self, value: Any) -> Any:
        return value if self.user_dtype is None else value.astype(self.user_dtype)  # a NumPy scalar stays one


class MirroredSession:
    """What a Session created while the rewrite is on runs instead of ``BaseSession``'s lowest
    layer (mixed in before its own class): every call that would reach the user's C session
    reaches the mirror's, with outputs and operations mapped by name. A mixin, not a subclass
    of ``BaseSession``: importing this module looks up no private name; ``patch_session_init``
    does, after ``_tf.require`` has checked them."""

    _amp_rewrite_settings: Any
    _amp_rewrite_show_once: Callable[[str], bool]
    _amp_rewrite_mirror: Mirror | None
    _amp_rewrite_lock: threading.Lock

    def _extend_graph(self) -> None:
        """Nothing: the user's C session never gets the graph; the mirror grows when a run needs it."""

    def _call_tf_sessionrun(self, options: Any, feed_dict: dict, fetch_list: list, target_list: list,
                            run_metadata: Any) -> list:
        mirror = self._mirror_with([_operation_name(o.oper) for o in (*feed_dict, *fetch_list)]
                                   + [_operation_name(t) for t in target_list])
        fetches = [mirror.fetch(output) for output in fetch_list]
        results = _tf.SESSION_RUN.get()(
            getattr(mirror.session, _tf.SESSION_HANDLE), options, mirror.feeds(feed_dict),
            [f.output for f in fetches], [mirror.operation(_operation_name(t)) for t in target_list], run_metadata)
        return [fetch.to_user(value) for fetch, value in zip(fetches, results)]

    def _call_tf_sessionprun(self, handle: Any, feed_dict: dict, fetch_list: list) -> list:
        mirror = self._mirror_with([_operation_name(o.oper) for o in (*feed_dict, *fetch_list)])
        fetches = [mirror.fetch(output) for output in fetch_list]
        results = _tf.SESSION_PRUN.get()(getattr(mirror.session, _tf.SESSION_HANDLE), handle,
                                         mirror.feeds(feed_dict), [f.output for f in fetches])
        return [fetch.to_user(value) for fetch, value in zip(fetches, results)]

    def partial_run_setup(self, fetches: Any, feeds: Any = None) -> Any:
        """``BaseSession.partial_run_setup`` on the mirror: TensorFlow's own fetch handler and feed
        expansions give the flat lists, which are set up in the mirror's C session."""
        if getattr(self, _tf.SESSION_CLOSED):
            raise RuntimeError("Attempted to use a closed Session.")
        if self.graph.version == 0:
            raise RuntimeError("The Session graph is empty. Add operations to the graph before calling run().")
        handler = _tf.FETCH_HANDLER.get()(self.graph, fetches, {})
        feed_tensors = [self.graph.as_graph_element(subfeed, allow_tensor=True, allow_operation=False)
                        for feed in _as_list(feeds) for subfeed in _partial_run_expansion(feed)]
        mirror = self._mirror_with([t.op.name for t in (*feed_tensors, *handler.fetches())]
                                   + [op.name for op in handler.targets()])
        return _tf.BASE_SESSION_DO_CALL.get()(
            self, _tf.SESSION_PRUN_SETUP.get(), getattr(mirror.session, _tf.SESSION_HANDLE),
            [mirror.output(t.op.name, t.value_index)[0] for t in feed_tensors],
            [mirror.output(t.op.name, t.value_index)[0] for t in handler.fetches()],
            [mirror.operation(op.name) for op in handler.targets()])

    def _make_callable_from_options(self, callable_options: config_pb2.CallableOptions) -> Any:
        """A callable of the mirror's C session (what tf_keras' graph-mode ``K.function`` runs):
        ``CallableOptions`` name tensors and operations, which the mirror names alike."""
        connections = [name for c in callable_options.tensor_connection for name in (c.from_tensor, c.to_tensor)]
        feeds, fetches = list(callable_options.feed), list(callable_options.fetch)
        names = [parse_tensor_name(n).node for n in (*feeds, *fetches, *connections, *callable_options.target)]
        mirror = self._mirror_with(names)
        inner = _tf.BASE_SESSION_CALLABLE.get()(mirror.session, callable_options)
        feed_dtypes = [self._changed_dtype(mirror, name, to_mirror=True) for name in feeds]
        fetch_dtypes = [self._changed_dtype(mirror, name, to_mirror=False) for name in fetches]
        if not any(feed_dtypes) and not any(fetch_dtypes):
            return inner
        return _CastingCallable(inner, feed_dtypes, fetch_dtypes)

    def close(self) -> None:
        mirror = self._amp_rewrite_mirror
        if mirror is not None:
            mirror.session.close()
        super().close()

    # --- mapping onto the mirror -----------------------------------------------------------

    def _changed_dtype(self, mirror: Mirror, name: str, *, to_mirror: bool) -> Any:
        """For tensor ``name`` whose dtype the rewrite changed, the NumPy dtype a value must be
        cast to (the mirror's for a feed, the user's for a fetch); else None."""
        tensor = parse_tensor_name(name)
        user = self.graph.get_operation_by_name(tensor.node).outputs[tensor.port].dtype
        _, inner = mirror.output(tensor.node, tensor.port)
        if user == inner:
            return None
        return (inner if to_mirror else user.base_dtype).as_numpy_dtype

    def _mirror_with(self, names: Iterable[str]) -> Mirror:
        """The mirror, grown first if it lacks a node of ``names``. Checked again under the lock:
        of threads racing the first run, one builds and the others find it built."""
        names = list(names)
        mirror = self._amp_rewrite_mirror
        if mirror is not None and all(name in mirror.nodes for name in names):
            return mirror
        with self._amp_rewrite_lock:
            mirror = self._amp_rewrite_mirror
            if mirror is None:
                self._amp_rewrite_mirror = _build(self)
            elif not all(name in mirror.nodes for name in names):
                _grow(self, mirror)
            return self._amp_rewrite_mirror


def _operation_name(operation: Any) -> str:
    return _tf.OPERATION_NAME.get()(operation)


def _as_list(feeds: Any) -> list:
    if feeds is None:
        return []
    return list(feeds) if isinstance(feeds, (list, tuple)) else [feeds]


def _partial_run_expansion(feed: Any) -> list:
    """The tensors ``feed`` stands for in a partial run (a SparseTensor placeholder: three), by
    TensorFlow's own expansions."""
    for tensor_type, _, _, expand in _tf.REGISTERED_EXPANSIONS.get():
        if isinstance(feed, tensor_type):
            return expand(feed)
    raise TypeError(f'Feed argument {feed} has invalid type "{type(feed).__name__}"')


class _CastingCallable:
    """A mirror callable whose feeds and fetches the rewrite converted: values cast on the way."""

    def __init__(self, inner: Any, feed_dtypes: Sequence[Any], fetch_dtypes: Sequence[Any]) -> None:
        self._inner, self._feed_dtypes, self._fetch_dtypes = inner, feed_dtypes, fetch_dtypes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(a if d is None else np.asarray(a).astype(d) for a, d in zip(args, self._feed_dtypes))
        results = self._inner(*args, **kwargs)
        return [r if d is None else r.astype(d) for r, d in zip(results, self._fetch_dtypes)]


# --- building and growing the mirror ---------------------------------------------------------


def _rewrite(session: MirroredSession,
             frozen: RewriteResult | None) -> tuple[graph_pb2.GraphDef, RewriteResult, list[str]]:
    """The user's GraphDef now, its rewrite with ``frozen``'s nodes frozen, and the initializers
    of the FP8 training state the rewrite added (run once, before the nodes they initialize)."""
    settings = session._amp_rewrite_settings  # pylint: disable=protected-access
    graph_def = session.graph.as_graph_def()
    result = rewrite_graph_def(graph_def, target=settings.target, lists=settings.lists,
                               cross_function=settings.cross_function, frozen=frozen)
    initializers: list[str] = []
    if settings.float8 is not None:
        result, initializers = float8.session_step(graph_def, result, settings.float8, settings.target,
                                                   settings.lists)
        if result.report.float8_matmuls and not float8.xla_jit_enabled(getattr(session, _tf.SESSION_CONFIG)) \
                and session._amp_rewrite_show_once("float8-emulated"):  # pylint: disable=protected-access
            warnings.warn(float8.emulated_warning("this Session's graph", result.report.float8_matmuls), stacklevel=6)
    log.debug("amp_rewrite: session graph version %d rewritten", session.graph.version)
    return graph_def, result, initializers


def _build(session: MirroredSession) -> Mirror:
    source, result, initializers = _rewrite(session, None)
    graph = tf.Graph()
    setattr(graph, MIRROR_GRAPH_ATTR, session.graph)
    with graph.as_default():
        tf.graph_util.import_graph_def(result.graph_def, name="")
    inner = tf.compat.v1.Session(target=session.sess_str, graph=graph, config=getattr(session, _tf.SESSION_CONFIG))
    _tf.BASE_SESSION_EXTEND_GRAPH.get()(inner)
    if initializers:
        inner.run([graph.get_operation_by_name(name) for name in initializers])
    return Mirror(graph, inner, result, {node.name: node for node in source.node},
                  {node.name: node for node in result.graph_def.node},
                  {f.signature.name: f for f in result.graph_def.library.function})


def _grow(session: MirroredSession, mirror: Mirror) -> None:
    """Import into ``mirror`` the nodes and functions the user's graph gained, painted around the
    frozen ones; refuse if the new ops would change one the mirror runs."""
    source, result, initializers = _rewrite(session, mirror.result)
    sources = {node.name: node for node in source.node}
    nodes = {node.name: node for node in result.graph_def.node}
    functions = {f.signature.name: f for f in result.graph_def.library.function}
    _check_frozen(mirror, sources, nodes, functions)
    new = graph_pb2.GraphDef()
    new.versions.CopyFrom(result.graph_def.versions)
    new.library.function.extend(f for name, f in functions.items() if name not in mirror.functions)
    # Inputs from running nodes are mapped onto them; control inputs from them are added after
    # the import (``import_graph_def`` maps those only under a name prefix, and names must match).
    input_map: dict[str, Any] = {}
    controls: dict[str, list[str]] = {}
    for node in result.graph_def.node:
        if node.name in mirror.nodes:
            continue
        copy = new.node.add()
        copy.CopyFrom(node)
        del copy.input[:]
        for name in node.input:
            tensor = parse_tensor_name(name)
            if tensor.node in mirror.nodes and tensor.is_control:
                controls.setdefault(node.name, []).append(tensor.node)
                continue
            copy.input.append(name)
            if tensor.node in mirror.nodes:
                input_map[f"{tensor.node}:{tensor.port}"] = mirror.graph.get_tensor_by_name(f"{tensor.node}:{tensor.port}")
    with mirror.graph.as_default():
        # A new op colocated with a running one (a table's lookup, a variable's read) names a node
        # outside ``new``: the mirror has it, so the constraint is kept, not checked here.
        _tf.IMPORT_GRAPH_DEF_INTERNAL.get()(new, input_map=input_map, name="", validate_colocation_constraints=False)
    add_control_inputs = _tf.ADD_CONTROL_INPUTS.get()
    for name, producers in controls.items():
        add_control_inputs(mirror.graph.get_operation_by_name(name),
                           [mirror.graph.get_operation_by_name(producer) for producer in producers])
    _tf.BASE_SESSION_EXTEND_GRAPH.get()(mirror.session)
    added = [mirror.graph.get_operation_by_name(name) for name in initializers if name not in mirror.nodes]
    if added:
        mirror.session.run(added)
    mirror.result, mirror.sources, mirror.nodes, mirror.functions = result, sources, nodes, functions
    log.debug("amp_rewrite: %d nodes added to the running mirror", len(new.node))


def _check_frozen(mirror: Mirror, sources: dict, nodes: dict, functions: dict) -> None:
    """Refuse, naming the new ops, when they change how a node or function the mirror already
    runs is rewritten. A node the user changed after it ran (an attribute TensorFlow sets when
    an op becomes a control dependency, say) keeps running as it was, as in TensorFlow's own
    Session, where such a change has no effect."""
    changed_node = next((name for name, node in mirror.nodes.items()
                         if nodes.get(name) != node and sources.get(name) == mirror.sources.get(name)), None)
    changed_function = next((name for name, f in mirror.functions.items() if functions.get(name) != f), None)
    if changed_node is None and changed_function is None:
        return
    added = [node for name, node in sources.items() if name not in mirror.nodes]
    if changed_node is not None:
        readers = [node for node in added if any(parse_tensor_name(name).node == changed_node for name in node.input)]
        what = f"'{changed_node}' ({mirror.nodes[changed_node].op})"
    else:
        readers, what = [], f"function '{changed_function}'"
    why = (f" (cross_function=True paints across the boundary of function '{changed_function}')"
           if changed_function is not None and changed_node is not None else "")
    named = ", ".join(f"'{node.name}' ({node.op})" for node in (readers or added)[:3])
    raise AmpRewriteError(
        f"amp_rewrite: op(s) {named} added after this Session's first run would change how {what}, which it"
        f" already runs, is rewritten{why}; create them before the first run, or run them in a new Session")
