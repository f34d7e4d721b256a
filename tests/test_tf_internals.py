"""The one door to TensorFlow's private names (``amp_rewrite/_tf.py``): every listed name is
there on the installed TensorFlow, and a feature whose name is gone or changed refuses in one
line naming the TensorFlow version, the name and the feature."""
from __future__ import annotations

import subprocess
import sys

import pytest

from amp_rewrite import _tf


def _refusal(script: str) -> str:
    """The one ``REFUSED ...`` line ``script`` prints, run in a fresh interpreter."""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(lines) == 1, run.stdout + run.stderr
    return lines[0]


def test_every_listed_name_is_there_on_the_installed_tensorflow():
    assert _tf.ENTRIES, "the table lists the private names"
    assert _tf.problems() == []


def test_a_name_removed_in_a_fresh_process_is_one_line_naming_version_name_and_feature():
    script = (
        "from tensorflow.python.eager.polymorphic_function import transform\n"
        "del transform.CONCRETE_FUNCTION_CALLBACKS\n"
        "from amp_rewrite import _tf\n"
        "try:\n"
        "    _tf.require(_tf.LIVE)\n"
        "except _tf.TensorFlowInternalsError as error:\n"
        "    print('REFUSED', error)\n"
    )
    line = _refusal(script)
    import tensorflow as tf

    assert f"TensorFlow {tf.__version__}" in line
    assert "transform.CONCRETE_FUNCTION_CALLBACKS is gone" in line
    assert _tf.LIVE in line


def test_a_changed_signature_is_refused(monkeypatch: pytest.MonkeyPatch):
    from tensorflow.python.client import session

    monkeypatch.setattr(session.BaseSession, "_call_tf_sessionprun", lambda self, feed_dict, handle, fetch_list: None)
    with pytest.raises(_tf.TensorFlowInternalsError, match=r"_call_tf_sessionprun takes \(feed_dict, handle"):
        _tf.require(_tf.SESSION)
    _tf.require(_tf.LIVE)  # another feature's names are not asked for


def test_the_pass_refuses_in_one_line_where_tensorflows_op_registry_is_gone():
    """The pass asks TensorFlow's private op-definition registry of every node (``_tf.PASS``):
    if a release removed it, importing amp_rewrite says so in one line naming the
    TensorFlow version, the name and the feature, instead of failing on the first node.
    (``import amp_rewrite`` alone loads no TensorFlow: the first rewrite does.)"""
    script = (
        "from tensorflow.python.framework import op_def_registry\n"
        "del op_def_registry.get\n"
        "import amp_rewrite\n"
        "from tensorflow.core.framework import graph_pb2\n"
        "try:\n"
        "    amp_rewrite.rewrite_graph_def(graph_pb2.GraphDef(), target='bfloat16')\n"
        "except Exception as error:\n"
        "    print('REFUSED', type(error).__name__, error)\n"
    )
    line = _refusal(script)
    import tensorflow as tf

    assert line.startswith("REFUSED TensorFlowInternalsError")
    assert f"TensorFlow {tf.__version__}" in line
    assert "op_def_registry.get is gone" in line
    assert "the graph rewrite" in line


def test_importing_the_session_path_looks_up_no_private_name():
    """The Session path reaches ``BaseSession`` only once enabling patches it, after
    ``_tf.require(SESSION)``: a release without it refuses in one line when the feature
    starts, and importing the module (which ``amp_rewrite``'s training path does) still works."""
    script = (
        "from tensorflow.python.client import session\n"
        "del session.BaseSession\n"
        "import amp_rewrite.training.session as mirrored\n"
        "from amp_rewrite import _tf\n"
        "try:\n"
        "    mirrored.patch_session_init(lambda: None)\n"
        "except _tf.TensorFlowInternalsError as error:\n"
        "    print('REFUSED', error)\n"
    )
    line = _refusal(script)
    assert "session.BaseSession is gone" in line
    assert _tf.SESSION in line
