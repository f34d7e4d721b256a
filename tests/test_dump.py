"""``write_dump``: the files a person reads after a rewrite, checked by parsing them back.

The graph: ``allow1`` (MatMul) → ``clr1`` (Relu) → a deny op (Exp) whose name carries a
``<script>`` tag → ``deny2`` (Relu) → ``deny3`` (AddV2), both painted deny → a functional ``While`` loop (a MatMul in its body) so the library
has functions. The browser test drives a real headless Chromium over the DevTools pipe.
"""
from __future__ import annotations

import html
import html.parser
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import markupsafe
import pytest
import tensorflow as tf
import yaml
from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2

import amp_rewrite
from amp_rewrite.cli import dump
from amp_rewrite.core import functions, support
from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.rules import Rule

from conftest import graph_def_of

DENY_NAME = 'deny1<script>window.pwned=1</script>&"'
TITLE = "dump <test> & co"
ROOT = Path(__file__).resolve().parent.parent


def _build() -> None:
    x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
    w = tf.constant([[0.1] * 4] * 4, name="w")
    allow1 = tf.matmul(x, w, name="allow1")
    clr1 = tf.nn.relu(allow1, name="clr1")
    deny1 = tf.exp(clr1, name="deny1")
    deny2 = tf.nn.relu(deny1, name="deny2")  # clear op between deny1 and an infer op: painted deny
    deny3 = tf.add(deny2, 1.0, name="deny3")  # infer op
    _, loop = tf.while_loop(lambda i, acc: i < 3, lambda i, acc: (i + 1, tf.matmul(acc, w)), [tf.constant(0), deny3])
    tf.identity(loop, name="output")


def _rename(graph_def: graph_pb2.GraphDef, old: str, new: str) -> None:
    for node in graph_def.node:
        if node.name == old:
            node.name = new
        node.input[:] = [
            ("^" + new if t == "^" + old else new + t[len(old):] if t == old or t.startswith(old + ":") else t)
            for t in node.input
        ]


@pytest.fixture(scope="module")
def rewrite() -> tuple[graph_pb2.GraphDef, amp_rewrite.RewriteResult, amp_rewrite.OpLists]:
    graph_def = graph_def_of(_build)
    _rename(graph_def, "deny1", DENY_NAME)
    lists = amp_rewrite.load_lists("float16")
    return graph_def, amp_rewrite.rewrite_graph_def(graph_def, target="float16", fetches=["output"], lists=lists), lists


@pytest.fixture(scope="module")
def dumped(rewrite, tmp_path_factory) -> tuple[Path, list[Path]]:
    original, result, lists = rewrite
    directory = tmp_path_factory.mktemp("dump") / "new"  # write_dump creates it
    return directory, dump.write_dump(directory, original, result, lists, title=TITLE)


def _escaped(text: str) -> str:
    """``text`` as the report's template writes it (Jinja2's autoescape: markupsafe)."""
    return str(markupsafe.escape(text))


def _without_library(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    copy.ClearField("library")
    return copy


def _function_names(result: amp_rewrite.RewriteResult) -> list[str]:
    return [item.function for item in result.report.items if item.function != MAIN_GRAPH]


def test_the_graph_has_the_expected_colours(rewrite):
    """The fixture graph exercises what the dump shows: a converted node, a deny node, functions."""
    _, result, _ = rewrite
    report = result.report
    assert report.decision("allow1").converted and report.decision("clr1").converted
    assert report.decision(DENY_NAME).rule == "deny-list"
    assert report.decision("deny2").rule == "deny-propagation"
    assert len(_function_names(result)) == 2  # the loop's body and cond


def test_writes_every_file_and_returns_them(rewrite, dumped):
    _, result, _ = rewrite
    directory, written = dumped
    stems = ["main"] + _function_names(result)  # TensorFlow's function names are already portable
    expected = {f"{side}/{stem}.pbtxt" for side in ("before", "after") for stem in stems}
    expected |= {f"graphs/{stem}.dot" for stem in stems}
    if shutil.which("dot"):
        expected |= {f"graphs/{stem}.svg" for stem in stems}
    expected |= {"lists.yaml", "report.html", f"tb/{dump.EVENTS_FILE}"}
    on_disk = {path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()}
    assert on_disk == expected
    assert sorted(path.relative_to(directory).as_posix() for path in written) == sorted(expected)


def test_pbtxt_parse_back_to_the_graph_defs(rewrite, dumped):
    """Main graph without its library; each function body as ``body_graph_def`` gives it."""
    original, result, _ = rewrite
    directory, _ = dumped
    for side, graph_def in (("before", original), ("after", result.graph_def)):
        parsed = text_format.Parse((directory / side / "main.pbtxt").read_text(encoding="utf-8"), graph_pb2.GraphDef())
        assert parsed == _without_library(graph_def), f"{side}/main.pbtxt"
        library = {f.signature.name: f for f in graph_def.library.function}
        for name in _function_names(result):
            body = functions.body_graph_def(library[name], support.library_op_defs(graph_def.library))
            text = (directory / side / f"{name}.pbtxt").read_text(encoding="utf-8")
            assert text_format.Parse(text, graph_pb2.GraphDef()) == body, f"{side}/{name}.pbtxt"
    assert (directory / "before" / "main.pbtxt").read_bytes() != (directory / "after" / "main.pbtxt").read_bytes()


def _dot_node_line(dot_text: str, name: str) -> str:
    quoted = dump._dot_quote(name)
    lines = [line for line in dot_text.splitlines() if line.strip().startswith(quoted + " [")]
    assert len(lines) == 1, f"node {name!r} is not declared exactly once in the DOT"
    return lines[0]


def test_dot_mentions_every_node_and_colours_by_decision(rewrite, dumped):
    _, result, _ = rewrite
    directory, _ = dumped
    dot_text = (directory / "graphs" / "main.dot").read_text(encoding="utf-8")
    for node in result.graph_def.node:
        _dot_node_line(dot_text, node.name)
    green, red, grey = (dump.CLASS_TO_STYLE[name][0] for name in ("converted", "deny", "clear"))
    assert f'fillcolor="{green}"' in _dot_node_line(dot_text, "allow1")
    assert f'fillcolor="{green}"' in _dot_node_line(dot_text, "clr1")
    assert f'fillcolor="{red}"' in _dot_node_line(dot_text, DENY_NAME)
    assert f'fillcolor="{red}"' in _dot_node_line(dot_text, "deny2")
    assert f'fillcolor="{grey}"' in _dot_node_line(dot_text, "output")  # clear op, fetched: kept float32
    casts = [node.name for node in result.graph_def.node if node.name.endswith("-AutoMixedPrecision")]
    assert casts and all("shape=cds" in _dot_node_line(dot_text, name) for name in casts)
    assert '"allow1" -> "clr1" [xlabel="float16"' in dot_text
    matmul = next(d for d in result.report.decisions if d.function != MAIN_GRAPH and d.op == "MatMul")
    body_dot = (directory / "graphs" / f"{matmul.function}.dot").read_text(encoding="utf-8")
    assert f'fillcolor="{green}"' in _dot_node_line(body_dot, matmul.node)


def test_second_dump_is_byte_identical(rewrite, dumped, tmp_path):
    original, result, lists = rewrite
    first, _ = dumped
    dump.write_dump(tmp_path, original, result, lists, title=TITLE)
    files = sorted(path.relative_to(first) for path in first.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*") if path.is_file())
    different = [str(path) for path in files if (first / path).read_bytes() != (tmp_path / path).read_bytes()]
    assert not different, f"not byte-identical: {different}"


def test_lists_yaml_holds_the_effective_lists(rewrite, dumped):
    _, _, lists = rewrite
    directory, _ = dumped
    document = yaml.safe_load((directory / "lists.yaml").read_text(encoding="utf-8"))
    assert document["target"] == "float16"
    assert document["keep_nodes"] == {entry: lists.keep_reasons.get(entry, "") for entry in lists.keep_nodes}
    for name in ("allow", "deny", "infer", "clear"):
        assert document[name] == sorted(getattr(lists, name)), name


def test_dump_shows_kept_nodes_with_their_rule_and_reason(rewrite, tmp_path):
    """keep_nodes: lists.yaml has the entries with their reasons (an overlay's mapping
    form); the report shows a kept node's rule, its meaning and the entry's reason, and
    the drawing colours it as a deny op."""
    original, _, _ = rewrite
    reason = "calibration: output 0 reached 2.1e+05, over float16's safe magnitude 1.6e+04"
    lists = amp_rewrite.load_lists("float16").keeping({"allow1": reason, "clr.*": ""})
    result = amp_rewrite.rewrite_graph_def(original, target="float16", fetches=["output"], lists=lists)
    dump.write_dump(tmp_path, original, result, lists, title=TITLE)
    document = yaml.safe_load((tmp_path / "lists.yaml").read_text(encoding="utf-8"))
    assert document["keep_nodes"] == {"allow1": reason, "clr.*": ""}
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    rows = {row[1]: row for row in _decision_rows(page) if row[0] == "main graph"}
    assert rows["allow1"][5:] == ("keep-nodes", reason)
    assert rows["clr1"][5:] == ("keep-nodes", "matches keep_nodes entry 'clr.*'")
    assert _escaped(Rule.KEEP_NODES.meaning) in page
    red = dump.CLASS_TO_STYLE["deny"][0]
    dot_text = (tmp_path / "graphs" / "main.dot").read_text(encoding="utf-8")
    assert f'fillcolor="{red}"' in _dot_node_line(dot_text, "allow1")


class _RowReader(html.parser.HTMLParser):
    """The cell texts of each ``<tr data-function=...>`` row (a decision)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, ...]] = []
        self._cells: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr" and any(name == "data-function" for name, _ in attrs):
            self._cells = []
        elif tag == "td" and self._cells is not None:
            self._cells.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._cells is not None:
            self.rows.append(tuple(self._cells))
            self._cells = None

    def handle_data(self, data: str) -> None:
        if self._cells:
            self._cells[-1] += data


def _decision_rows(page: str) -> list[tuple[str, ...]]:
    reader = _RowReader()
    reader.feed(page)
    return reader.rows


def test_report_html_lists_every_decision_and_escapes_names(rewrite, dumped):
    _, result, _ = rewrite
    directory, _ = dumped
    page = (directory / "report.html").read_text(encoding="utf-8")
    rows = _decision_rows(page)
    expected = [
        ("main graph" if d.function == MAIN_GRAPH else d.function, d.node, d.op, d.attr, f"{d.before} → {d.after}",
         d.rule, d.reason)
        for d in result.report.decisions
    ]
    assert rows == expected
    assert "window.pwned" in page and "<script>window.pwned" not in page
    assert page.count("<script>") == 1  # ours
    assert _escaped(TITLE) in page and TITLE not in page
    for item in result.report.items:
        assert _escaped(result.report.summary(item.function)) in page
    assert "http://" not in page and "https://" not in page  # nothing to fetch: opens from file://


def test_svg_is_skipped_above_the_node_limit(rewrite, tmp_path, monkeypatch):
    """A graph too big for Graphviz keeps its .dot; the report says why there is no SVG."""
    if not shutil.which("dot"):
        pytest.skip("Graphviz's dot is not installed (apt-get install -y graphviz)")
    original, result, lists = rewrite
    monkeypatch.setattr(dump, "SVG_MAX_NODES", 12)
    dump.write_dump(tmp_path, original, result, lists, title=TITLE)
    assert (tmp_path / "graphs" / "main.dot").is_file() and not (tmp_path / "graphs" / "main.svg").exists()
    assert f"{len(result.graph_def.node)} nodes (limit 12)" in (tmp_path / "report.html").read_text(encoding="utf-8")


def test_dump_without_graphviz_still_writes_everything_else(rewrite, tmp_path, monkeypatch):
    original, result, lists = rewrite
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    written = dump.write_dump(tmp_path / "d", original, result, lists, title=TITLE)
    assert not [path for path in written if path.suffix == ".svg"]
    assert "Graphviz's dot is not installed" in html.unescape((tmp_path / "d" / "report.html").read_text(encoding="utf-8"))


def test_lists_of_another_target_are_refused(rewrite, tmp_path):
    original, result, _ = rewrite
    with pytest.raises(ValueError, match="lists are for 'bfloat16' but the rewrite converted to 'float16'"):
        dump.write_dump(tmp_path, original, result, amp_rewrite.load_lists("bfloat16"), title=TITLE)


def test_file_names_are_portable_and_distinct():
    taken: set[str] = set()
    stems = []
    for name in ("f", "a/b", "a_b", "main", "F", "..x"):
        stems.append(dump._file_stem(name, taken))
        taken.add(stems[-1].lower())
    assert stems[0] == "f" and stems[2] == "a_b"
    assert len({stem.lower() for stem in stems}) == len(stems)
    assert all(stem.replace("-", "").replace("_", "").replace(".", "").isalnum() for stem in stems)
    assert not any(stem.startswith(".") for stem in stems)


def test_tensorboard_log_holds_the_rewritten_graph(rewrite, dumped):
    """The event file holds the rewritten graph once, and TensorBoard's own reader (in the
    test extras) reads it back."""
    from tensorboard.backend.event_processing import event_accumulator

    _, result, _ = rewrite
    directory, _ = dumped
    events = list(tf.compat.v1.train.summary_iterator(str(directory / "tb" / dump.EVENTS_FILE)))
    graphs = [event.graph_def for event in events if event.graph_def]
    assert len(graphs) == 1
    assert graph_pb2.GraphDef.FromString(graphs[0]) == result.graph_def
    accumulator = event_accumulator.EventAccumulator(str(directory / "tb"))
    accumulator.Reload()
    assert graph_pb2.GraphDef.FromString(accumulator.Graph().SerializeToString()) == result.graph_def


# --------------------------------------------------------------------------------------
# A real browser


def _browser_tool():
    spec = importlib.util.spec_from_file_location("check_report_in_browser", ROOT / "tools" / "check_report_in_browser.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _row_text(decision: amp_rewrite.Decision) -> str:
    item = "main graph" if decision.function == MAIN_GRAPH else decision.function
    fields = (item, decision.node, decision.op, decision.attr, f"{decision.before} → {decision.after}",
              decision.rule, decision.reason)
    return "".join(fields).lower()


def test_report_filters_rows_as_you_type_in_chromium(rewrite, dumped, tmp_path):
    """Typing into the search box, ticking "kept float32 only" and choosing a rule hide rows."""
    browser_tool = _browser_tool()
    executable = browser_tool.find_chromium()
    if executable is None:
        pytest.skip(
            f"no Chromium binary on PATH ({', '.join(browser_tool.CHROMIUM_NAMES)}); "
            "install it: apt-get install -y chromium"
        )
    _, result, _ = rewrite
    directory, _ = dumped
    decisions = result.report.decisions
    rows_js = browser_tool.VISIBLE_ROWS_JS

    def wait_rows(page, expected: int, what: str) -> None:
        try:
            page.wait_for(f"{rows_js} === {expected}", timeout=10)
        except browser_tool.BrowserError:
            pass
        assert page.evaluate(rows_js) == expected, what

    with browser_tool.Chromium(executable) as browser:
        page = browser.open((directory / "report.html").as_uri())
        assert page.evaluate("document.getElementById('count').textContent") == f"{len(decisions)} of {len(decisions)} rows"
        assert page.evaluate(rows_js) == len(decisions)
        assert page.evaluate("typeof window.pwned") == "undefined", "a node name ran as a script"
        assert page.evaluate("document.title") == TITLE

        page.type("#search", "deny-list")
        wait_rows(page, sum("deny-list" in _row_text(d) for d in decisions), "typing 'deny-list'")
        assert page.evaluate("document.querySelector('#nodes tbody tr:not([hidden]) td.name').textContent") == DENY_NAME
        page.type("#search", " nothing-matches-this")
        wait_rows(page, 0, "typing a word no row has")
        assert page.evaluate("!document.getElementById('empty').hidden")
        page.clear("#search")
        wait_rows(page, len(decisions), "clearing the search box")

        page.click("#kept")
        wait_rows(page, sum(not d.converted for d in decisions), "ticking 'kept float32 only'")
        page.click("#kept")
        wait_rows(page, len(decisions), "unticking 'kept float32 only'")
        page.evaluate("var r = document.getElementById('rule'); r.value = 'allow-list';"
                      " r.dispatchEvent(new Event('change'))")
        wait_rows(page, sum(d.rule == "allow-list" for d in decisions), "choosing rule allow-list")

        screenshot = page.screenshot(tmp_path / "report.png", full_page=True)
    assert screenshot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_every_rule_the_pass_gives_has_a_meaning_in_the_report():
    """report.html explains each rule in words: every Reason in the package names a Rule
    member (no bare string), and every Rule has a one-line meaning the report shows."""
    sources = {path: path.read_text(encoding="utf-8") for path in (ROOT / "amp_rewrite").rglob("*.py")}
    bare = {f"{path.name}: {rule}" for path, text in sources.items() for rule in re.findall(r'Reason\(\s*"([^"]*)"', text)}
    assert bare == set()
    named = {name for text in sources.values() for name in re.findall(r"Reason\(\s*Rule\.([A-Z0-9_]+)", text)}
    assert {"ALLOW_LIST", "SLOWER_CONVERTED", "UNLISTED", "DENY_PROPAGATION"} <= named <= set(Rule.__members__)
    for rule in Rule:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.value) and rule.meaning.strip(), rule
        assert dump._meaning(rule.value) == rule.meaning
