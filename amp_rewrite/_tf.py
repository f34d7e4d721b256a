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

from amp_rewrite.errors import AmpRewriteError

# The features that rest on private names, as the refusal names them.
LIVE = "the live rewrite (enable_mixed_precision_graph_rewrite, mixed_precision)"
SESSION = "the Session path (a tf.compat.v1.Session created while the rewrite is on)"
FLOAT8_TRAINING = "FP8 training (target='float8')"
OPTIMIZERS = "the loss-scale optimizer wrappers"
PASS = "the graph rewrite (TensorFlow's op definitions and kernel registry)"


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


def tensorflow_release() -> str:
    """The installed TensorFlow's version string, as messages name it."""
    try:
        return importlib.import_module("tensorflow").version.VERSION
    except (ImportError, AttributeError):
        return "(unknown version)"


def tensorflow_version() -> tuple[int, int]:
    """The installed TensorFlow's (major, minor): the one place a release is compared."""
    major, minor = tensorflow_release().split(".")[:2]
    return int(major), int(minor)


def require(feature: str) -> None:
    """Refuse, in one line, to start ``feature`` when a private name it needs is missing or changed."""
    for entry in ENTRIES:
        if entry.feature == feature:
            problem = entry.problem()
            if problem is not None:
                raise TensorFlowInternalsError(
                    f"amp_rewrite: {feature} cannot work with TensorFlow {tensorflow_release()}: its private"
                    f" {entry.name} {problem}; use a TensorFlow release this amp_rewrite supports"
                    " (pyproject.toml), or report it")


def problems() -> list[tuple[Private, str]]:
    """Every listed name that cannot be used as we rely on it (for the test and ``--version``)."""
    return [(entry, problem) for entry in ENTRIES if (problem := entry.problem()) is not None]


# --- the live rewrite (training/live.py) ------------------------------------------------------
# TensorFlow has no public hook on tracing: these two lists are what tf.function runs for each
# new FuncGraph and ConcreteFunction (tf.debugging's dumping callback uses the second one too).
CONCRETE_FUNCTION_CALLBACKS = Private(LIVE, "tensorflow.python.eager.polymorphic_function.transform",
                                      "CONCRETE_FUNCTION_CALLBACKS")
FUNC_GRAPH_TRANSFORMS = Private(LIVE, "tensorflow.python.eager.polymorphic_function.transform",
                                "FUNC_GRAPH_TRANSFORMS")
# The eager context's function library: the only way to replace a traced function's body by name.
EAGER_CONTEXT = Private(LIVE, "tensorflow.python.eager.context", "context")
CONTEXT_GET_FUNCTION_DEF = Private(LIVE, "tensorflow.python.eager.context", "Context.get_function_def", ("name",))
CONTEXT_HAS_FUNCTION = Private(LIVE, "tensorflow.python.eager.context", "Context.has_function", ("name",))
CONTEXT_REMOVE_FUNCTION = Private(LIVE, "tensorflow.python.eager.context", "Context.remove_function", ("name",))
CONTEXT_ADD_FUNCTION_DEF = Private(LIVE, "tensorflow.python.eager.context", "Context.add_function_def", ("fdef",))
# A private copy becomes a child of the trace's AtomicFunction, so it is exported and kept with it.
ATOMIC_FUNCTION = Private(LIVE, "tensorflow.python.eager.polymorphic_function.atomic_function", "AtomicFunction",
                          ("name", "bound_context", "function_type"))
# TensorFlow's "graph rewrite enabled" flag: what makes tf_keras refuse a mixed policy (no public setter).
GRAPH_REWRITE_ENABLED = Private(LIVE, "tensorflow.python.training.experimental.mixed_precision_global_state",
                                "is_mixed_precision_graph_rewrite_enabled", ())
SET_GRAPH_REWRITE_ENABLED = Private(LIVE, "tensorflow.python.training.experimental.mixed_precision_global_state",
                                    "set_mixed_precision_graph_rewrite_enabled", ("enabled",))
USING_MIXED_PRECISION_POLICY = Private(LIVE, "tensorflow.python.training.experimental.mixed_precision_global_state",
                                       "is_using_mixed_precision_policy", ())

# --- the Session path (training/session.py) ---------------------------------------------------
# A Session has no hook between its graph and its C session: the mirror replaces the lowest layer
# of BaseSession (the methods below, overridden or called) and keeps everything above it.
BASE_SESSION = Private(SESSION, "tensorflow.python.client.session", "BaseSession")
SESSION_INIT = Private(SESSION, "tensorflow.python.client.session", "BaseSession.__init__",
                       ("target", "graph", "config"))
BASE_SESSION_EXTEND_GRAPH = Private(SESSION, "tensorflow.python.client.session", "BaseSession._extend_graph", ())
BASE_SESSION_CALL_TF_SESSIONRUN = Private(SESSION, "tensorflow.python.client.session",
                                          "BaseSession._call_tf_sessionrun",
                                          ("options", "feed_dict", "fetch_list", "target_list", "run_metadata"))
BASE_SESSION_CALL_TF_SESSIONPRUN = Private(SESSION, "tensorflow.python.client.session",
                                           "BaseSession._call_tf_sessionprun", ("handle", "feed_dict", "fetch_list"))
BASE_SESSION_MAKE_CALLABLE_FROM_OPTIONS = Private(SESSION, "tensorflow.python.client.session",
                                                  "BaseSession._make_callable_from_options", ("callable_options",))
BASE_SESSION_DO_CALL = Private(SESSION, "tensorflow.python.client.session", "BaseSession._do_call", ("fn",))
BASE_SESSION_CALLABLE = Private(SESSION, "tensorflow.python.client.session", "BaseSession._Callable",
                                ("session", "callable_options"))
# What BaseSession.__init__ sets and the mirror reads: the C session it runs, the ConfigProto a
# mirror's own Session is made with, whether it is closed (instance attributes, no public getter).
SESSION_HANDLE, SESSION_CONFIG, SESSION_CLOSED = "_session", "_config", "_closed"
# partial_run_setup's own fetch handling and feed expansions, reused rather than written again.
FETCH_HANDLER = Private(SESSION, "tensorflow.python.client.session", "_FetchHandler", ("graph", "fetches", "feeds"))
REGISTERED_EXPANSIONS = Private(SESSION, "tensorflow.python.client.session", "_REGISTERED_EXPANSIONS")
# The C API the Session itself runs the mirror's graph with.
SESSION_RUN = Private(SESSION, "tensorflow.python.client.pywrap_tf_session", "TF_SessionRun_wrapper")
SESSION_PRUN = Private(SESSION, "tensorflow.python.client.pywrap_tf_session", "TF_SessionPRun_wrapper")
SESSION_PRUN_SETUP = Private(SESSION, "tensorflow.python.client.pywrap_tf_session", "TF_SessionPRunSetup_wrapper")
OPERATION_NAME = Private(SESSION, "tensorflow.python.client.pywrap_tf_session", "TF_OperationName")
OPERATION_OUTPUT_TYPE = Private(SESSION, "tensorflow.python.client.pywrap_tf_session", "TF_OperationOutputType")
TENSOR_AS_TF_OUTPUT = Private(SESSION, "tensorflow.python.client._pywrap_tf_session", "PyTensor._as_tf_output")
OPERATION_C_OP = Private(SESSION, "tensorflow.python.client._pywrap_tf_session", "PyOperation._c_op")
# Control inputs from running nodes onto new ones: import_graph_def maps them only under a prefix.
ADD_CONTROL_INPUTS = Private(SESSION, "tensorflow.python.client._pywrap_tf_session", "PyOperation._add_control_inputs")
IMPORT_GRAPH_DEF_INTERNAL = Private(SESSION, "tensorflow.python.framework.importer", "_import_graph_def_internal",
                                    ("graph_def",))
# The process's default ConfigProto, which a Session without a config runs with.
SESSION_EAGER_CONTEXT = Private(SESSION, "tensorflow.python.eager.context", "context")

# --- FP8 training (training/float8.py, core/float8/training.py) -------------------------------
# Whether a FuncGraph is compiled by XLA, including from an outer function's jit_compile.
CONTROL_FLOW_UTIL = Private(FLOAT8_TRAINING, "tensorflow.python.ops.control_flow_util",
                            "GraphOrParentsInXlaContext", ("graph",))
# Loop bodies and branches: their captures are fixed before the FuncGraph transform runs.
CONTROL_FLOW_FUNC_GRAPH = Private(FLOAT8_TRAINING, "tensorflow.python.ops.control_flow_v2_func_graphs",
                                  "ControlFlowFuncGraph")
# A FuncGraph's call-time captures (distribution strategies use them) come last among its inputs.
DEFERRED_INTERNAL_CAPTURES = Private(FLOAT8_TRAINING, "tensorflow.python.framework.func_graph",
                                     "FuncGraph.deferred_internal_captures")

# --- the loss-scale optimizers (training/optimizers.py, training/keras_optimizer.py, training/skips.py) ---
# Keras 3's LossScaleOptimizer methods our subclass overrides: a fixed scale (no public option),
# skipped steps decided on all replicas together, and the scale kept within [1, float32 max].
KERAS_TF_APPLY = Private(OPTIMIZERS, "keras", "mixed_precision.LossScaleOptimizer._tf_apply",
                         ("grads", "trainable_variables"))
KERAS_HANDLE_FINITE = Private(OPTIMIZERS, "keras", "mixed_precision.LossScaleOptimizer._stateful_handle_finite_grads",
                              ("grads", "trainable_variables"))
KERAS_HANDLE_NON_FINITE = Private(OPTIMIZERS, "keras",
                                  "mixed_precision.LossScaleOptimizer._stateful_handle_non_finite_grads", ())
# Keras' own test of whether a step needs a merge call (tf.__internal__ is TensorFlow's door for Keras).
STRATEGY_SUPPORTS_NO_MERGE_CALL = Private(OPTIMIZERS, "tensorflow",
                                          "__internal__.distribute.strategy_supports_no_merge_call", ())
# XLA cannot call Python nor write summaries: the skip counter (training/skips.py) only counts under it.
OPTIMIZERS_XLA_CONTEXT = Private(OPTIMIZERS, "tensorflow.python.ops.control_flow_util",
                                 "GraphOrParentsInXlaContext", ("graph",))
# TF1's loss-scale optimizer has no public get_scaled_loss/get_unscaled_gradients: its own halves.
V1_SCALE_LOSS = Private(OPTIMIZERS, "tensorflow.python.training.experimental.loss_scale_optimizer",
                        "MixedPrecisionLossScaleOptimizer._scale_loss", ("loss",))
V1_UNSCALE_GRADS = Private(OPTIMIZERS, "tensorflow.python.training.experimental.loss_scale_optimizer",
                           "MixedPrecisionLossScaleOptimizer._unscale_grads", ("grads",))
# TF1's fixed scale that skips is a DynamicLossScale that never grows (optimizers._FixedLossScale).
V1_DYNAMIC_LOSS_SCALE = Private(OPTIMIZERS, "tensorflow.python.training.experimental.loss_scale",
                                "DynamicLossScale.__init__", ("initial_loss_scale", "increment_period", "multiplier"))
# tf_keras' wrapper keeps its scale's state (whose update(grads) decides each step) in ``_loss_scale``
# (no public getter): its skipped steps are counted there (skips.count_in_update).
TF_KERAS_LOSS_SCALE = "_loss_scale"
# A Keras 3 optimizer lists the variables it updates only here (the training doctor's default variables=).
KERAS_TRAINABLE_VARIABLES = "_trainable_variables"
# TF1's optimizer takes nothing but its deprecated loss scales: their notice is silenced.
DEPRECATION_SILENCE = Private(OPTIMIZERS, "tensorflow.python.util.deprecation", "silence", ())
# TF1 wrappers do not track attributes by assignment: the float8 state is tracked by hand.
TRACK_TRACKABLE = Private(OPTIMIZERS, "tensorflow.python.trackable.base", "Trackable._track_trackable",
                          ("trackable", "name"))

# --- the pass and its support checks (core/) --------------------------------------------------

# No public API gives an op's OpDef or its registered kernels: grappler's questions
# (SupportsF16DataType, IsKernelRegisteredForNode) can only be asked here (core/support.py).
OP_DEF_REGISTRY_GET = Private(PASS, "tensorflow.python.framework.op_def_registry", "get", ("name",))
REGISTERED_KERNELS_FOR_OP = Private(PASS, "tensorflow.python.framework.kernels", "get_registered_kernels_for_op",
                                    ("name",))

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

ORACLE = "grappler as an oracle (amp_rewrite.testing.reference: the conformance tests and tools)"
# grappler's AMP pass run on its own has no public entry (tf.config.optimizer runs it inside
# a function call, on the local devices); the oracle needs it on a virtual cluster.
OPTIMIZE_GRAPH = Private(ORACLE, "tensorflow.python.grappler.tf_optimizer", "OptimizeGraph",
                         ("config_proto", "metagraph", "verbose", "graph_id", "cluster", "strip_default_attributes"))
GRAPPLER_CLUSTER = Private(ORACLE, "tensorflow.python.grappler.cluster", "Cluster",
                           ("allow_soft_placement", "disable_detailed_stats", "disable_timeline", "devices"))
ONEDNN_DTYPE_SUPPORTED = Private(ORACLE, "tensorflow.python.util._pywrap_utils", "IsDataTypeSupportedByOneDNNOnThisCPU")

# --- the measuring tools (tools/calibration_models_report.py) ---------------------------------
TOOLS = "the measuring tools (tools/*.py)"
# Freezing a signature into one GraphDef (variables as constants, bodies inlined) has no public v2
# entry; tf.compat.v1.graph_util's works on a Session's graph only.
CONVERT_VARIABLES_TO_CONSTANTS = Private(TOOLS, "tensorflow.python.framework.convert_to_constants",
                                         "convert_variables_to_constants_v2", ("func",))

ENTRIES: tuple[Private, ...] = tuple(value for value in dict(globals()).values() if isinstance(value, Private))
