"""What TensorFlow itself says an op supports: op definitions and registered kernels.

Grappler asks two questions before it paints a type attribute with the target dtype
(spec §2.2, §2.4): does the op definition allow that dtype (``SupportsF16DataType``), and
is a kernel registered for the node with that one attribute changed, on the node's
device (``SupportsF16``: ``IsKernelRegisteredForNode``). Both are answered here from
TensorFlow's registries, with caches, so the colouring passes stay pure Python.
"""
from __future__ import annotations

import functools
from typing import Mapping

from tensorflow.core.framework import (
    attr_value_pb2,
    function_pb2,
    node_def_pb2,
    op_def_pb2,
)
from amp_rewrite import _tf
from amp_rewrite.errors import GraphError

_tf.require(_tf.PASS)  # at import: the pass asks these on every node
_op_def = _tf.OP_DEF_REGISTRY_GET.get()
_registered_kernels = _tf.REGISTERED_KERNELS_FOR_OP.get()


def registered_op_def(op: str) -> op_def_pb2.OpDef | None:
    """The OpDef in TensorFlow's global registry, or None (e.g. a library function)."""
    return _op_def(op)


def library_op_defs(library: function_pb2.FunctionDefLibrary | None) -> dict[str, op_def_pb2.OpDef]:
    """Function signatures by name: a node whose op is a function uses its signature."""
    if library is None:
        return {}
    return {function.signature.name: function.signature for function in library.function}


def resolve_op_def(
    node_def: node_def_pb2.NodeDef, functions: Mapping[str, op_def_pb2.OpDef]
) -> op_def_pb2.OpDef:
    """Op definition from the graph's library first, then the registry (as grappler does)."""
    op_def = functions.get(node_def.op) or registered_op_def(node_def.op)
    if op_def is None:
        raise GraphError(
            f"node '{node_def.name}': op '{node_def.op}' is neither registered in TensorFlow nor a"
            " function in the graph's library; load the library that defines it"
            " (tf.load_op_library) or remove the node"
        )
    return op_def


def default_attrs(op: str, op_def: op_def_pb2.OpDef) -> tuple:
    """(name, AttrValue) for each attr of ``op_def`` that has a default value.

    SavedModels and ``tf.io.write_graph`` strip default-valued attrs (e.g. ``Reshape``'s
    ``Tshape``); the pass adds them back to its working copy, since a missing type attr
    would otherwise be read as no dtype at all.
    """
    return _registered_defaults(op) if registered_op_def(op) is op_def else _defaults_of(op_def)


def _defaults_of(op_def: op_def_pb2.OpDef) -> tuple:
    return tuple((a.name, a.default_value) for a in op_def.attr if a.HasField("default_value"))


@functools.lru_cache(maxsize=None)
def _registered_defaults(op: str) -> tuple:
    return _defaults_of(registered_op_def(op))


@functools.lru_cache(maxsize=None)
def _attr_def(op: str, attr: str) -> op_def_pb2.OpDef.AttrDef | None:
    op_def = registered_op_def(op)
    if op_def is None:
        return None
    return next((a for a in op_def.attr if a.name == attr), None)


@functools.lru_cache(maxsize=None)
def op_allows_dtype(op: str, attr: str, fixed: int, dtype: int) -> bool:
    """``SupportsF16DataType``: the registered op's attr (or fixed arg type) admits dtype.

    Ops missing from the global registry (function calls) never qualify; an attr without
    ``allowed_values`` admits every type.
    """
    if registered_op_def(op) is None:
        return False
    if not attr:
        return fixed == dtype
    attr_def = _attr_def(op, attr)
    if attr_def is None:
        return False
    allowed = attr_def.allowed_values.list.type
    return not allowed or dtype in allowed


@functools.lru_cache(maxsize=None)
def _kernels(op: str, device_type: str, label: str) -> tuple:
    registered = _registered_kernels(op).kernel
    return tuple(k for k in registered if k.device_type == device_type and k.label == label)


class _MissingAttr(Exception):
    """A kernel constrains an attr the node lacks: TensorFlow reports an error, not a miss."""


def _constraint_met(constraint, attrs: Mapping[str, object]) -> bool:
    value = attrs.get(constraint.name)
    if value is None:
        raise _MissingAttr(constraint.name)
    allowed = constraint.allowed_values.list
    for field in ("type", "s", "i", "b"):
        allowed_values = getattr(allowed, field)
        if not allowed_values:
            continue
        if value.WhichOneof("value") == "list":
            return all(v in allowed_values for v in getattr(value.list, field))
        return getattr(value, field) in allowed_values
    return False


@functools.lru_cache(maxsize=None)
def _constrained_attrs(op: str) -> tuple[str, ...]:
    registered = _registered_kernels(op).kernel
    return tuple(sorted({c.name for k in registered for c in k.constraint}))


def has_kernel(node_def: node_def_pb2.NodeDef, attrs: Mapping[str, object], device_type: str) -> bool:
    """``IsKernelRegisteredForNode`` for ``node_def`` with ``attrs`` (AttrValue by name).

    Matches device type, the ``_kernel`` label and every constraint; like TensorFlow's
    registry, falls back to ``DEFAULT`` kernels when none for the device type match.
    """
    label_value = attrs.get("_kernel")
    label = label_value.s.decode() if label_value is not None else ""
    relevant = tuple(
        attrs[name].SerializeToString(deterministic=True) if name in attrs else None
        for name in _constrained_attrs(node_def.op)
    )
    return _has_kernel(node_def.op, device_type, label, relevant, attrs)


@functools.cache
def kernel_inputs(op: str, attr: str, listed: bool) -> tuple[str, ...] | None:
    """What ``has_kernel_with_type`` for ``attr`` of an unlabelled ``op`` node reads besides
    the op: the other type attrs its kernels constrain, whose values decide with the op.

    None when it reads more: a constrained attr that is not a type, or the rest of the
    changed list (``listed``: the attr is a ``list(type)`` one its kernels constrain).
    """
    constrained = _constrained_attrs(op)
    if not constrained:
        return ()
    op_def = registered_op_def(op)
    if op_def is None or listed and attr in constrained:
        return None
    kinds = {a.name: a.type for a in op_def.attr}
    others = tuple(name for name in constrained if name != attr)
    return others if all(kinds.get(name) == "type" for name in others) else None


def has_kernel_with_type(node_def: node_def_pb2.NodeDef, attr: str, dtype: int, device_type: str) -> bool:
    """``has_kernel`` for ``node_def`` with its type attr ``attr`` set to ``dtype``.

    Same answer and cache entry as ``has_kernel`` on a changed copy of the attrs, but the
    attrs are copied only when the cache misses: the pass asks once per float32 vertex.
    """
    attrs = node_def.attr
    label = attrs["_kernel"].s.decode() if "_kernel" in attrs else ""
    constrained = _constrained_attrs(node_def.op)
    if constrained == (attr,) and not label:  # the usual case: the answer depends on the op only
        return _has_kernel_for_type(node_def.op, attr, dtype, device_type)
    changed = _type_value_bytes(dtype)  # an AttrValue holds one value: setting .type replaces it
    if constrained == (attr,):
        relevant: tuple = (changed,)
    else:
        relevant = tuple(
            changed if name == attr else attrs[name].SerializeToString(deterministic=True) if name in attrs else None
            for name in constrained
        )
    cache_key = (node_def.op, device_type, label, relevant)
    found = _KERNEL_CACHE.get(cache_key)
    if found is None:
        changed_attrs = dict(attrs)
        changed_attrs[attr] = attr_value_pb2.AttrValue(type=dtype)
        found = _KERNEL_CACHE[cache_key] = _find_kernel(node_def.op, device_type, label, changed_attrs)
    return found


@functools.cache
def _has_kernel_for_type(op: str, attr: str, dtype: int, device_type: str) -> bool:
    """``has_kernel_with_type`` for an unlabelled node of an op whose kernels constrain only ``attr``."""
    changed = attr_value_pb2.AttrValue(type=dtype)
    return _has_kernel(op, device_type, "", (_type_value_bytes(dtype),), {attr: changed})


@functools.cache
def _type_value_bytes(dtype: int) -> bytes:
    return attr_value_pb2.AttrValue(type=dtype).SerializeToString(deterministic=True)


def _has_kernel(op: str, device_type: str, label: str, key: tuple, attrs: Mapping[str, object]) -> bool:
    cache_key = (op, device_type, label, key)
    if cache_key not in _KERNEL_CACHE:
        _KERNEL_CACHE[cache_key] = _find_kernel(op, device_type, label, attrs)
    return _KERNEL_CACHE[cache_key]


_KERNEL_CACHE: dict[tuple, bool] = {}


def _find_kernel(op: str, device_type: str, label: str, attrs: Mapping[str, object]) -> bool:
    try:
        for candidate_device in (device_type, "DEFAULT"):
            for kernel in _kernels(op, candidate_device, label):
                if all(_constraint_met(c, attrs) for c in kernel.constraint):
                    return True
    except _MissingAttr:
        return False
    return False
