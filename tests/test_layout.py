"""The package's layering (README, Layout): ``core`` imports nothing above it, the layers on
top of it not each other, and no module imports itself back; and the house rules every
module keeps: functions of at most 60 lines and 6 positional parameters, private TensorFlow
modules only through ``_tf.py`` (``tools/import_graph.py``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _import_graph_tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_upward_import_and_no_cycle(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    tool = _import_graph_tool()
    monkeypatch.setattr(sys, "argv", ["import_graph.py", str(ROOT / "amp_rewrite")])
    assert tool.main() == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "upward imports: none" in out and "import cycles: none" in out
    assert "(function size, positional parameters, private TensorFlow modules): kept" in out
    assert "amp_rewrite.core.rewrite ->" in out and "[training]" in out


def test_the_tool_sees_an_upward_import_and_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]):
    package = tmp_path / "amp_rewrite"
    for folder in (package, package / "core", package / "cli", package / "calibration"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (package / "core" / "a.py").write_text("from amp_rewrite.core import b\n")
    (package / "core" / "b.py").write_text("from amp_rewrite.core.a import x\nfrom amp_rewrite.cli import c\n")
    (package / "cli" / "c.py").write_text("from amp_rewrite.calibration import d\n")  # downward: fine
    (package / "calibration" / "d.py").write_text("from amp_rewrite.cli import e\n")
    (package / "cli" / "e.py").write_text("")
    monkeypatch.setattr(sys, "argv", ["import_graph.py", str(package)])
    assert _import_graph_tool().main() == 1
    out = capsys.readouterr().out
    assert "amp_rewrite.core.b (core) -> amp_rewrite.cli.c (cli)" in out
    assert "amp_rewrite.core.a -> amp_rewrite.core.b -> amp_rewrite.core.a" in out
    assert "amp_rewrite.calibration.d (calibration) -> amp_rewrite.cli.e (cli)" in out
    assert "amp_rewrite.cli.c (cli) ->" not in out


def test_the_tool_sees_each_breach_of_the_house_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]):
    package = tmp_path / "amp_rewrite"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    long_body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (package / "core" / "a.py").write_text(
        f"def long():\n{long_body}\n"
        "def fits():\n" + "".join(f"    x{i} = {i}\n" for i in range(59)) + "\n"
        "def many(a, b, c, d, e, f, g):\n    pass\n\n"
        "def six_and_options(a, b, c, d, e, f, *, g=1):\n    pass\n\n"
        "class C:\n    def method(self, a, b, c, d, e, f):\n        pass\n"
        "from tensorflow.python.framework import ops\n"
        "import importlib\nimportlib.import_module('keras.src.backend')\n")
    (package / "_tf.py").write_text("from tensorflow.python.eager import context\n")  # the one door
    monkeypatch.setattr(sys, "argv", ["import_graph.py", str(package)])
    assert _import_graph_tool().main() == 1
    breaches = [line.strip() for line in capsys.readouterr().out.split("private TensorFlow modules): ", 1)[1]
                .strip().splitlines()]
    assert len(breaches) == 4, breaches  # not fits (60 lines), six_and_options, method, nor _tf.py
    assert breaches[0].startswith("amp_rewrite/core/a.py:1 long: 61 lines; split it")
    assert breaches[1].startswith("amp_rewrite/core/a.py:124 many: 7 positional parameters; pass one frozen value")
    assert breaches[2].startswith("amp_rewrite/core/a.py:133 ")
    assert breaches[2].endswith(" imports tensorflow.python.framework, a private module; reach it through amp_rewrite._tf")
    assert breaches[3].startswith("amp_rewrite/core/a.py:135 imports keras.src.backend, a private module")
