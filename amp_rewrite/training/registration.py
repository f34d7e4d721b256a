"""Make ``import amp_rewrite`` enough for ``keras.models.load_model`` to find our optimizer.

A ``.keras`` file names the wrapper by its registered name (``amp_rewrite>LossScaleOptimizer``),
and Keras only finds classes registered in this process. ``import amp_rewrite`` must not
import TensorFlow itself (the ``amp-rewrite`` command quiets TensorFlow's start-up first),
so the class is registered the moment Keras has finished loading: at once if it already
has, otherwise from a one-shot import hook on the ``keras`` package. No TensorFlow import
happens here.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Sequence

KERAS = "keras"
KERAS_OPTIMIZER = "amp_rewrite.training.keras_optimizer"


def _register() -> None:
    importlib.import_module(KERAS_OPTIMIZER)  # its class decorator registers it


class _AfterKerasLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself; lets the other finders find ``keras`` and registers our class once
    Keras' own ``__init__`` has run (TensorFlow imports Keras while it loads, so this is also
    how ``import tensorflow`` after ``import amp_rewrite`` registers it)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != KERAS:
            return None
        # Stay in place until Keras is executed: TensorFlow asks importlib.util.find_spec("keras")
        # before it imports it, and that spec is thrown away.
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_keras = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            exec_keras(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register_when_keras_loads() -> None:
    """Register the Keras loss-scale optimizer now if Keras is loaded, else right after it loads."""
    keras = sys.modules.get(KERAS)
    if keras is not None and hasattr(keras, "saving"):
        _register()
    elif keras is None and not any(isinstance(f, _AfterKerasLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasLoads())
