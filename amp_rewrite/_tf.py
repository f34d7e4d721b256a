"""The one door to TensorFlow's and Keras' private names.

Every name amp_rewrite uses that TensorFlow or Keras does not publish (a module under
``tensorflow.python``, an underscore attribute, a private method a subclass overrides) is
listed here as a ``Private``, with the feature that needs it and the leading parameters we
call or override it with. A feature checks its names before it changes anything
(``require``); where one is gone or its parameters changed, it refuses in one line that
names the TensorFlow version, the name and the feature — never a silent float32 run or a
"not found" far from the cause. Call sites reach a name only through its entry
(``ENTRY.get()``), so this table is the whole list; the README's "TensorFlow internals"
section says why each remains private.

Sections are by feature; each is kept by the modules that use it.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from amp_rewrite.core.errors import AmpRewriteError

# The features that rest on private names, as the refusal names them.
LIVE = "the live rewrite (enable_mixed_precision_graph_rewrite, mixed_precision)"
SESSION = "the Session path (a tf.compat.v1.Session created while the rewrite is on)"
FLOAT8_TRAINING = "FP8 training (target='float8')"
OPTIMIZERS = "the loss-scale optimizer wrappers"


class TensorFlowInternalsError(AmpRewriteError):
    """A private TensorFlow or Keras name a feature needs is missing or changed."""


@dataclass(frozen=True)
class Private:
    """One private name: ``module`` imported, then ``attribute`` (dotted) looked up in it.
    ``parameters``: the leading parameter names (after ``self``) of a callable, checked by
    ``require``; None where only its presence matters."""

    feature: str
    module: str
    attribute: str = ""
    parameters: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}" if self.attribute else self.module

    def get(self) -> Any:
        """The object (its feature's ``require`` has said it is there)."""
        value: Any = importlib.import_module(self.module)
        for part in filter(None, self.attribute.split(".")):
            value = getattr(value, part)
        return value

    def problem(self) -> str | None:
        """Why this name cannot be used as we rely on it, or None."""
        try:
            value = self.get()
        except (ImportError, AttributeError):
            return "is gone"
        if self.parameters is None:
            return None
        try:
            names = [p for p in inspect.signature(value).parameters if p not in ("self", "cls")]
        except (TypeError, ValueError):  # a builtin without a signature: presence is what we can check
            return None
        if tuple(names[:len(self.parameters)]) != self.parameters:
            return f"takes ({', '.join(names)}), not ({', '.join(self.parameters)}, ...)"
        return None


def _tensorflow_version() -> str:
    try:
        return importlib.import_module("tensorflow").__version__
    except (ImportError, AttributeError):
        return "(unknown version)"


def require(feature: str) -> None:
    """Refuse, in one line, to start ``feature`` when a private name it needs is missing or changed."""
    for entry in ENTRIES:
        if entry.feature == feature:
            problem = entry.problem()
            if problem is not None:
                raise TensorFlowInternalsError(
                    f"amp_rewrite: {feature} cannot work with TensorFlow {_tensorflow_version()}: its private"
                    f" {entry.name} {problem}; use a TensorFlow release this amp_rewrite supports"
                    " (pyproject.toml), or report it")


def problems() -> list[tuple[Private, str]]:
    """Every listed name that cannot be used as we rely on it (for the test and ``--version``)."""
    return [(entry, problem) for entry in ENTRIES if (problem := entry.problem()) is not None]


# --- the live rewrite (training/live.py) ------------------------------------------------------

CONCRETE_FUNCTION_CALLBACKS = Private(LIVE, "tensorflow.python.eager.polymorphic_function.transform",
                                      "CONCRETE_FUNCTION_CALLBACKS")
FUNC_GRAPH_TRANSFORMS = Private(LIVE, "tensorflow.python.eager.polymorphic_function.transform",
                                "FUNC_GRAPH_TRANSFORMS")
EAGER_CONTEXT = Private(LIVE, "tensorflow.python.eager.context", "context")
ATOMIC_FUNCTION = Private(LIVE, "tensorflow.python.eager.polymorphic_function.atomic_function", "AtomicFunction",
                          ("name", "bound_context", "function_type"))
MIXED_PRECISION_GLOBAL_STATE = Private(LIVE, "tensorflow.python.training.experimental.mixed_precision_global_state")

# --- the Session path (training/session.py) ---------------------------------------------------

SESSION_MODULE = Private(SESSION, "tensorflow.python.client.session")
BASE_SESSION_EXTEND_GRAPH = Private(SESSION, "tensorflow.python.client.session", "BaseSession._extend_graph", ())
BASE_SESSION_CALL_TF_SESSIONRUN = Private(SESSION, "tensorflow.python.client.session",
                                          "BaseSession._call_tf_sessionrun",
                                          ("options", "feed_dict", "fetch_list", "target_list", "run_metadata"))
BASE_SESSION_CALL_TF_SESSIONPRUN = Private(SESSION, "tensorflow.python.client.session",
                                           "BaseSession._call_tf_sessionprun", ("handle", "feed_dict", "fetch_list"))
BASE_SESSION_MAKE_CALLABLE_FROM_OPTIONS = Private(SESSION, "tensorflow.python.client.session",
                                                  "BaseSession._make_callable_from_options", ("callable_options",))
C_API = Private(SESSION, "tensorflow.python.client.pywrap_tf_session")
IMPORT_GRAPH_DEF_INTERNAL = Private(SESSION, "tensorflow.python.framework.importer", "_import_graph_def_internal",
                                    ("graph_def",))

# --- FP8 training (training/float8.py, core/float8_training.py) -------------------------------

CONTROL_FLOW_UTIL = Private(FLOAT8_TRAINING, "tensorflow.python.ops.control_flow_util",
                            "GraphOrParentsInXlaContext", ("graph",))

# --- the loss-scale optimizers (training/optimizers.py, training/keras_optimizer.py) ----------

# --- the pass and its support checks (core/) --------------------------------------------------

# --- weights and SavedModels (core/weights.py, cli/weights.py, calibration/savedmodel.py) -----

SAVED_MODEL_WRITING = "writing a SavedModel (convert)"
# The rewrite spells out default-valued attrs; a file that promises them stripped is stripped again.
STRIP_DEFAULT_ATTRS = Private(SAVED_MODEL_WRITING, "tensorflow.python.framework.meta_graph",
                              "strip_graph_default_valued_attrs", ("meta_graph_def",))
# fingerprint.pb hashes the graph and the checkpoint's index; TensorFlow publishes only the reader.
WRITE_FINGERPRINT = Private(SAVED_MODEL_WRITING, "tensorflow.python.saved_model.fingerprinting_utils",
                            "write_fingerprint", ("export_dir",))

# --- calibration (calibration/statistics.py, calibration/calibrate.py) ------------------------
# None: public APIs do the job (tf.make_ndarray, tf.make_tensor_proto, tf.compat.v1.saved_model.loader;
# the loader's deprecation warning is dropped by a filter on tf.get_logger(), not deprecation.silence).

# --- the grappler oracle and the dumps (testing/reference.py, cli/dump.py) --------------------

# grappler's AMP pass run on its own has no public entry (tf.config.optimizer runs it inside
# a function call, on the local devices); the oracle needs it on a virtual cluster.
ORACLE = "grappler as an oracle (amp_rewrite.testing.reference: the conformance tests and tools)"
OPTIMIZE_GRAPH = Private(ORACLE, "tensorflow.python.grappler.tf_optimizer", "OptimizeGraph",
                         ("config_proto", "metagraph", "verbose", "graph_id", "cluster", "strip_default_attributes"))
GRAPPLER_CLUSTER = Private(ORACLE, "tensorflow.python.grappler.cluster", "Cluster",
                           ("allow_soft_placement", "disable_detailed_stats", "disable_timeline", "devices"))
ONEDNN_DTYPE_SUPPORTED = Private(ORACLE, "tensorflow.python.util._pywrap_utils", "IsDataTypeSupportedByOneDNNOnThisCPU")

ENTRIES: tuple[Private, ...] = tuple(value for value in dict(globals()).values() if isinstance(value, Private))
