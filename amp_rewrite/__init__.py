"""amp_rewrite: automatic mixed precision for TensorFlow graphs by graph rewriting.

The public API is the names in ``__all__``; everything else is private. Names are loaded
on first use, so ``amp-rewrite`` can quiet TensorFlow's start-up logging before
TensorFlow is imported. The Keras optimizer wrapper is registered with Keras' saving as
soon as Keras loads, so ``import amp_rewrite`` is enough to load a ``.keras`` file.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from amp_rewrite.errors import AmpRewriteError, GraphError, ListsError
from amp_rewrite.training.registration import register_when_keras_loads

if TYPE_CHECKING:
    from amp_rewrite.calibration.calibrate import Calibration, calibrate
    from amp_rewrite.calibration.diverge import Divergence, find_divergence
    from amp_rewrite.calibration.speed import StepTuning, Tuning, tune, tune_step
    from amp_rewrite.core.lists import Colour, OpLists, load_float8, load_lists
    from amp_rewrite.training.live import disable_mixed_precision_graph_rewrite, enable_mixed_precision_graph_rewrite, mixed_precision
    from amp_rewrite.core.report import Decision, Report
    from amp_rewrite.core.rewrite import RewriteResult, rewrite_graph_def
    from amp_rewrite.core.target import TARGETS
    from amp_rewrite.core.canonical import Canonical, to_float32
    from amp_rewrite.training.doctor import Diagnosis, Doctor, diagnose_step
    from amp_rewrite.training.doctor_float8 import Float8Finding, diagnose_float8
    from amp_rewrite.training.doctor_session import DoctorHook, diagnose_session_step

_NAME_TO_MODULE = {
    "Calibration": "calibration.calibrate", "calibrate": "calibration.calibrate",
    "Divergence": "calibration.diverge", "find_divergence": "calibration.diverge",
    "Tuning": "calibration.speed", "tune": "calibration.speed",
    "StepTuning": "calibration.speed", "tune_step": "calibration.speed",
    "TARGETS": "core.target", "Colour": "core.lists", "OpLists": "core.lists", "load_lists": "core.lists",
    "load_float8": "core.lists",
    "Decision": "core.report", "Report": "core.report",
    "RewriteResult": "core.rewrite", "rewrite_graph_def": "core.rewrite",
    "Canonical": "core.canonical", "to_float32": "core.canonical",
    "enable_mixed_precision_graph_rewrite": "training.live", "disable_mixed_precision_graph_rewrite": "training.live",
    "mixed_precision": "training.live",
    "Doctor": "training.doctor", "Diagnosis": "training.doctor", "diagnose_step": "training.doctor",
    "Float8Finding": "training.doctor_float8", "diagnose_float8": "training.doctor_float8",
    "DoctorHook": "training.doctor_session", "diagnose_session_step": "training.doctor_session",
}

__all__ = [
    "AmpRewriteError",
    "Calibration",
    "Canonical",
    "Colour",
    "Decision",
    "Diagnosis",
    "Divergence",
    "Doctor",
    "DoctorHook",
    "Float8Finding",
    "GraphError",
    "ListsError",
    "OpLists",
    "Report",
    "RewriteResult",
    "StepTuning",
    "TARGETS",
    "Tuning",
    "calibrate",
    "diagnose_float8",
    "diagnose_session_step",
    "diagnose_step",
    "disable_mixed_precision_graph_rewrite",
    "enable_mixed_precision_graph_rewrite",
    "find_divergence",
    "load_float8",
    "load_lists",
    "mixed_precision",
    "rewrite_graph_def",
    "to_float32",
    "tune",
    "tune_step",
]


def __getattr__(name: str) -> Any:
    if name not in _NAME_TO_MODULE:
        raise AttributeError(f"module 'amp_rewrite' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"amp_rewrite.{_NAME_TO_MODULE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


register_when_keras_loads()
