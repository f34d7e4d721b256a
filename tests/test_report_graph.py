"""report.html draws the rewritten graph: Graphviz's SVG inline when ``dot`` is there, else
the built-in layered layout, which needs nothing installed; a big item is bounded to its
converted region and the page says so. Checked as text, and in headless Chromium at the
report's width: every node drawn, names on one line inside their boxes, the page no wider
than the window, a click on a node filtering the decisions to it.
"""
from __future__ import annotations

import html
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import tensorflow as tf

import amp_rewrite
from amp_rewrite.cli import dump, graph_view

from conftest import graph_def_of

ROOT = Path(__file__).resolve().parent.parent
NASTY = 'deny1<script>window.pwned=1</script>&"'
NODE_TITLES = re.compile(r'<g (?:id="[^"]*" )?class="node">\s*<title>(.*?)</title>', re.S)


def _build() -> None:
    x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
    w = tf.constant([[0.1] * 8] * 8, name="w")
    allow1 = tf.matmul(x, w, name="allow1")
    clr1 = tf.nn.relu(allow1, name="clr1")
    deny1 = tf.exp(clr1, name="deny1")
    allow2 = tf.matmul(deny1, w, name="a_rather_long_scope/with/a_rather_long_node_name_allow2")
    # One wide layer: the drawing is wider than the window, which must scroll inside its box.
    branches = [tf.nn.relu(allow2, name=f"branch_{i}_with_a_name_long_enough_to_widen_its_layer") for i in range(8)]
    tf.identity(tf.add_n(branches, name="sum"), name="output")


@pytest.fixture(scope="module")
def rewrite():
    graph_def = graph_def_of(_build)
    for node in graph_def.node:  # a name that must be escaped everywhere
        node.name = NASTY if node.name == "deny1" else node.name
        node.input[:] = [NASTY if tensor == "deny1" else tensor for tensor in node.input]
    lists = amp_rewrite.load_lists("float16")
    return graph_def, amp_rewrite.rewrite_graph_def(graph_def, target="float16", fetches=["output"], lists=lists), lists


def _dump(rewrite, directory: Path, monkeypatch, *, graphviz: bool) -> str:
    if not graphviz:
        real_which = shutil.which
        monkeypatch.setattr(dump.shutil, "which", lambda name, *a, **k: None if name == "dot" else real_which(name, *a, **k))
    elif shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed: apt-get install -y graphviz")
    original, result, lists = rewrite
    dump.write_dump(directory, original, result, lists, title="graph test")
    return (directory / "report.html").read_text(encoding="utf-8")


def _titles(page: str) -> list[str]:
    return [html.unescape(title).strip() for title in NODE_TITLES.findall(page)]


@pytest.mark.parametrize("graphviz", [True, False], ids=["graphviz", "built-in"])
def test_report_draws_every_node_of_the_rewritten_graph(rewrite, tmp_path, monkeypatch, graphviz):
    """Each node of the rewritten main graph is one drawn node, its name escaped; who drew it is said."""
    page = _dump(rewrite, tmp_path, monkeypatch, graphviz=graphviz)
    _, result, _ = rewrite
    expected = sorted(node.name for node in result.graph_def.node)
    assert sorted(_titles(page)) == expected
    assert "drawn by Graphviz" in page if graphviz else "drawn by amp_rewrite&#39;s layout" in page
    assert "<script>window.pwned" not in page
    # The drawing repeats no decision's reason (its rows hold them; a click there shows them).
    drawing = page[page.index('<h2 id="graph">'):page.index("<h2>Why nodes stayed float32</h2>")]
    assert not [d.reason for d in result.report.decisions if html.escape(d.reason, quote=False) in drawing]
    if not graphviz:
        assert "no SVG: Graphviz&#39;s dot is not installed" in page


def test_a_big_item_is_bounded_to_its_converted_region_and_says_so(rewrite, tmp_path, monkeypatch):
    """Past the limit only converted nodes, casts and their neighbours are drawn, with a note."""
    monkeypatch.setattr(graph_view, "LAYOUT_MAX_NODES", 6)
    monkeypatch.setattr(graph_view.bound, "__defaults__", (6,))
    page = _dump(rewrite, tmp_path, monkeypatch, graphviz=False)
    _, result, _ = rewrite
    drawn = _titles(page)
    assert 0 < len(drawn) <= 6
    assert f"{len(drawn)} of {len(result.graph_def.node)} nodes drawn (limit 6): the converted region" in page
    converted = {d.node for d in result.report.decisions if d.converted}
    assert set(drawn) & converted, "the converted region holds converted nodes"


def _browser_tool():
    spec = importlib.util.spec_from_file_location("check_report_in_browser", ROOT / "tools" / "check_report_in_browser.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# Per drawn node: [name, its name text's width, its box's width, how many text lines hold the name].
NODE_FITS_JS = """Array.prototype.map.call(document.querySelectorAll('.graph-box g.node'), function (g) {
  var name = g.querySelector('title').textContent;
  var texts = Array.prototype.filter.call(g.querySelectorAll('text'), function (t) { return t.textContent === name; });
  var shape = g.querySelector('rect, polygon, path, ellipse');
  return [name, texts.length ? texts[0].getBBox().width : -1, shape.getBBox().width, texts.length];
})"""


@pytest.mark.parametrize("graphviz", [True, False], ids=["graphviz", "built-in"])
def test_the_graph_reads_at_the_report_width_in_chromium(rewrite, tmp_path, monkeypatch, graphviz):
    """In a 1280-pixel window: the drawing shows, each name is one line inside its box, the page
    does not get wider than the window, and a click on a node filters the decisions to it."""
    browser_tool = _browser_tool()
    executable = browser_tool.find_chromium()
    if executable is None:
        pytest.skip(f"no Chromium binary on PATH ({', '.join(browser_tool.CHROMIUM_NAMES)}); apt-get install -y chromium")
    _dump(rewrite, tmp_path, monkeypatch, graphviz=graphviz)
    long_name = "a_rather_long_scope/with/a_rather_long_node_name_allow2"
    with browser_tool.Chromium(executable, width=1280) as browser:
        page = browser.open((tmp_path / "report.html").as_uri())
        assert page.evaluate("typeof window.pwned") == "undefined", "a node name ran as a script"
        assert page.evaluate("document.querySelector('.graph-box svg').getBoundingClientRect().height") > 100
        fits = page.evaluate(NODE_FITS_JS)
        _, result, _ = rewrite
        assert len(fits) == len(result.graph_def.node)
        for name, text_width, box_width, lines in fits:
            if graphviz and name != long_name:
                continue  # Graphviz labels casts by their dtypes, other nodes "name\\nop": checked on one
            assert lines == 1, f"{name!r} is not on one line"
            assert 0 < text_width <= box_width, f"{name!r} ({text_width:.0f} px) overflows its box ({box_width:.0f} px)"
        assert page.evaluate("document.querySelector('.graph-box svg').getBoundingClientRect().width > window.innerWidth")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "the graph widens the page"
        page.evaluate("document.querySelectorAll('.graph-box g.node').forEach(function (g) {"
                      f" if (g.querySelector('title').textContent === {long_name!r})"
                      " g.dispatchEvent(new MouseEvent('click', {bubbles: true})); })")
        assert page.evaluate("document.getElementById('search').value") == long_name
        visible = page.evaluate("Array.prototype.filter.call(document.querySelectorAll('#nodes tbody tr'),"
                                " function (r) { return !r.hidden; }).map(function (r) { return r.textContent; })")
        assert visible and all(long_name in row.replace("\u200b", "") for row in visible)
