"""The Session path: a ``tf.compat.v1.Session`` created while the rewrite is on runs our rewrite.

TensorFlow's Session reads its graph from the C++ graph behind ``tf.Graph`` and extends
it run by run; there is no Python hook between the two, and a node a Session has run may
not change. So such a Session never runs the user's graph itself: at each ``run`` it runs
a private *mirror* — ``rewrite_graph_def`` of the user's GraphDef (our lists, overlays,
environment variables, target), imported into a private ``tf.Graph`` with the same node
names — in a private Session with the same target and config. Fetches and feeds are
mapped by name; a fetched value whose dtype the rewrite changed comes back in the user
graph's dtype.

When the user's graph grows between runs (a Saver, an eval op), it is rewritten again;
the nodes the mirror already has are normally rewritten the same way and only the new
ones are imported. If the new ops change how an old node is painted, the mirror is
rebuilt and the values of its initialized resource variables are carried over (other
state, such as queues or iterators, starts afresh; README).

Grappler's own auto_mixed_precision is left off in every Session created while the
rewrite is on, unless the config turns it on explicitly: TensorFlow would switch it on
when the global "graph rewrite enabled" flag is set (``session.py``), which this package
sets only so that tf_keras refuses a mixed policy.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.client import session as session_lib

from amp_rewrite.core.rewrite import rewrite_graph_def

log = logging.getLogger(__name__)

# Set on each Session: the settings it was created under (a live.LiveRewrite), or None.
SETTINGS_ATTR = "_amp_rewrite_settings"
MIRROR_ATTR = "_amp_rewrite_mirror"
CARRY_SCOPE = "amp_rewrite_carry"  # the mirror's own ops, named apart from the user's
_installed = False


@dataclass
class Mirror:
    """The rewritten copy of one user graph that a private Session runs."""

    graph: tf.Graph
    session: tf.compat.v1.Session
    version: int  # the user graph's version it mirrors
    nodes: dict[str, node_def_pb2.NodeDef] = field(default_factory=dict)  # as rewritten
    functions: dict[str, function_pb2.FunctionDef] = field(default_factory=dict)  # as rewritten
    rebuilds: int = 0


def install(active: Callable[[], Any]) -> None:
    """Route Sessions created from now on through ``run_rewritten`` (once); ``active()`` gives
    the live settings a new Session takes, or None when the rewrite is off."""
    global _installed
    if _installed:
        return
    _installed = True
    original_init, original_run, original_close = (session_lib.BaseSession.__init__, session_lib.BaseSession.run,
                                                   session_lib.BaseSession.close)

    @functools.wraps(original_init)
    def __init__(self, target: str = "", graph: tf.Graph | None = None, config: Any = None) -> None:
        settings = active()
        if settings is not None:
            config = _without_grappler_amp(config)
        original_init(self, target, graph, config)
        setattr(self, SETTINGS_ATTR, settings)

    @functools.wraps(original_run)
    def run(self, fetches: Any, feed_dict: Any = None, options: Any = None, run_metadata: Any = None) -> Any:
        if getattr(self, SETTINGS_ATTR, None) is None:
            return original_run(self, fetches, feed_dict, options, run_metadata)
        return run_rewritten(self, fetches, feed_dict, options, run_metadata)

    @functools.wraps(original_close)
    def close(self) -> None:
        mirror = getattr(self, MIRROR_ATTR, None)
        if mirror is not None:
            mirror.session.close()
        original_close(self)

    session_lib.BaseSession.__init__ = __init__
    session_lib.BaseSession.run = run
    session_lib.BaseSession.close = close


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
    from tensorflow.python.eager import context

    return context.context().config


def run_rewritten(session: Any, fetches: Any, feed_dict: Any, options: Any, run_metadata: Any) -> Any:
    """``session.run`` on the rewritten mirror of ``session.graph``."""
    mirror = _current_mirror(session)
    graph = session.graph

    def inner(element: Any) -> Any:
        """The mirror's element of the same name (a variable fetches its value, as in Session)."""
        as_element = getattr(element, "_as_graph_element", None)
        if as_element is not None and not isinstance(element, (tf.Tensor, tf.Operation)):
            element = as_element()
        if isinstance(element, (tf.Tensor, tf.Operation)) and element.graph is graph:
            return mirror.graph.as_graph_element(element.name)
        return element

    mapped_fetches = tf.nest.map_structure(inner, fetches)
    mapped_feeds = None
    if feed_dict is not None:
        mapped_feeds = {}
        for key, value in feed_dict.items():
            target = mirror.graph.as_graph_element(key) if isinstance(key, str) else inner(key)
            original = graph.as_graph_element(key) if isinstance(key, str) else key
            if (isinstance(target, tf.Tensor) and isinstance(original, tf.Tensor) and target.dtype != original.dtype
                    and target.dtype.is_floating and not isinstance(value, tf.Tensor)):
                value = np.asarray(value).astype(target.dtype.as_numpy_dtype)
            mapped_feeds[target] = value
    results = mirror.session.run(mapped_fetches, mapped_feeds, options, run_metadata)

    def outer_dtype(element: Any, result: Any) -> Any:
        if not isinstance(result, (np.ndarray, np.generic)):
            return result
        original = graph.as_graph_element(element) if isinstance(element, str) else element
        if isinstance(original, tf.Tensor) and original.dtype.is_floating and result.dtype != original.dtype.as_numpy_dtype:
            return np.asarray(result).astype(original.dtype.as_numpy_dtype)
        return result

    return tf.nest.map_structure(outer_dtype, fetches, results)


def _current_mirror(session: Any) -> Mirror:
    """The mirror of ``session.graph`` as it is now: built, extended with new ops, or rebuilt."""
    mirror: Mirror | None = getattr(session, MIRROR_ATTR, None)
    graph = session.graph
    if mirror is not None and mirror.version == graph.version:
        return mirror
    settings = getattr(session, SETTINGS_ATTR)
    rewritten = rewrite_graph_def(graph.as_graph_def(), target=settings.target, lists=settings.lists,
                                  cross_function=settings.cross_function).graph_def
    log.debug("amp_rewrite: session graph version %d rewritten", graph.version)
    nodes = {node.name: node for node in rewritten.node}
    functions = {f.signature.name: f for f in rewritten.library.function}
    if (mirror is not None and all(nodes.get(name) == node for name, node in mirror.nodes.items())
            and all(functions.get(name) == f for name, f in mirror.functions.items())):
        _extend(mirror, rewritten, nodes, functions)
        mirror.version = graph.version
        return mirror
    fresh = _build(session, rewritten, graph.version, nodes, functions)
    if mirror is not None:
        _carry_variables(mirror, fresh)
        fresh.rebuilds = mirror.rebuilds + 1
        mirror.session.close()
    setattr(session, MIRROR_ATTR, fresh)
    return fresh


def _build(session: Any, rewritten: graph_pb2.GraphDef, version: int, nodes: dict, functions: dict) -> Mirror:
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(rewritten, name="")
    inner = tf.compat.v1.Session(target=session.sess_str, graph=graph, config=session._config)  # pylint: disable=protected-access
    setattr(inner, SETTINGS_ATTR, None)  # the mirror's own Session runs as it is
    return Mirror(graph, inner, version, nodes, functions)


def _extend(mirror: Mirror, rewritten: graph_pb2.GraphDef, nodes: dict, functions: dict) -> None:
    """Import the nodes and functions ``rewritten`` has and the mirror lacks, wired to the mirror's nodes."""
    new = graph_pb2.GraphDef()
    new.versions.CopyFrom(rewritten.versions)
    new.library.function.extend(f for name, f in functions.items() if name not in mirror.functions)
    input_map: dict[str, Any] = {}
    for node in rewritten.node:
        if node.name in mirror.nodes:
            continue
        new.node.add().CopyFrom(node)
        for name in node.input:
            source = name.lstrip("^").split(":")[0]
            if source in mirror.nodes:
                key = name if name.startswith("^") or ":" in name else f"{name}:0"
                input_map[key] = mirror.graph.get_operation_by_name(source) if name.startswith("^") \
                    else mirror.graph.get_tensor_by_name(key)
    with mirror.graph.as_default():
        tf.graph_util.import_graph_def(new, input_map=input_map, name="")
    mirror.nodes, mirror.functions = nodes, functions


def _carry_variables(old: Mirror, new: Mirror) -> None:
    """Copy the initialized resource variables' values from the old mirror into the new one."""
    handles = [node for node in old.graph.as_graph_def().node if node.op == "VarHandleOp"
               and node.name in new.nodes and new.nodes[node.name].op == "VarHandleOp"]
    if not handles:
        return
    with old.graph.as_default(), tf.name_scope(CARRY_SCOPE):
        initialized = [tf.raw_ops.VarIsInitializedOp(resource=old.graph.get_tensor_by_name(f"{h.name}:0"))
                       for h in handles]
    flags = old.session.run(initialized)
    handles = [h for h, flag in zip(handles, flags) if flag]
    if not handles:
        return
    with old.graph.as_default(), tf.name_scope(CARRY_SCOPE):
        reads = [tf.raw_ops.ReadVariableOp(resource=old.graph.get_tensor_by_name(f"{h.name}:0"), dtype=h.attr["dtype"].type)
                 for h in handles]
    values = old.session.run(reads)
    with new.graph.as_default(), tf.name_scope(CARRY_SCOPE):
        placeholders = [tf.compat.v1.placeholder(v.dtype) for v in values]
        assigns = [tf.raw_ops.AssignVariableOp(resource=new.graph.get_tensor_by_name(f"{h.name}:0"), value=p)
                   for h, p in zip(handles, placeholders)]
    new.session.run(assigns, dict(zip(placeholders, values)))
    log.debug("amp_rewrite: carried %d variables into the rebuilt mirror", len(handles))


def is_mirrored(session: Any) -> bool:
    """Whether ``session`` runs the rewritten mirror (it was created while the rewrite was on)."""
    return getattr(session, SETTINGS_ATTR, None) is not None

