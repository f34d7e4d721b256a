"""A CLI that teaches itself: each command's help, --calibrate's value, "did you mean" for
names that are not there, one total per model, and models already in mixed precision.

The help is read from the parser in process (no TensorFlow needed); the rest runs the
command on small SavedModels and GraphDef files written here.
"""
from __future__ import annotations

import html
import re
import shlex
from pathlib import Path

import pytest

import amp_rewrite
from amp_rewrite.calibration import savedmodel
from amp_rewrite.cli import options, steps
from amp_rewrite.errors import GraphError, closest_names

from cli_models import graph_def_with_deny_path, save_module, write_graph_def
from test_cli import assert_ok, error_line, listing, run_cli

COMMANDS = options.COMMANDS
READ_ONLY = ("calibrate", "inspect", "explain", "dump")  # they write no model


def help_of(*command: str) -> str:
    run = run_cli(*command, "--help")
    assert run.code == 0, run.err
    return run.out


def examples_of(text: str) -> list[str]:
    """The command lines under ``examples:``, their comments dropped."""
    section = text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in section.splitlines() if line.strip()]


# --------------------------------------------------------------------------------------
# 1. Help


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_a_one_line_description_and_examples_of_itself(command: str) -> None:
    """Its --help opens with one sentence and shows examples of this command, each a command
    line the parser takes; the top-level list shows the same sentence."""
    text = help_of(command)
    description = text.split("\n\n")[1]
    assert "\n" not in description and description.endswith("."), description
    examples = examples_of(text)
    assert any(line.startswith(f"amp-rewrite {command} ") for line in examples), examples
    for line in examples:
        options.build_parser().parse_args(shlex.split(line)[1:])  # a usage error exits 2: the test fails
    listed = " ".join(help_of().split())
    assert " ".join(description.rstrip(".").split()).lower() in listed.lower()


def test_convert_help_is_about_convert() -> None:
    """convert --help: its options, examples and weights note, not the other commands' examples
    nor the top-level text again."""
    text = help_of("convert")
    commands = [line.strip() for line in text.splitlines() if line.startswith("  amp-rewrite ")]
    assert commands and all(line.startswith("amp-rewrite convert ") for line in commands), commands
    assert text.count("examples:") == 1, text
    assert options.DESCRIPTION not in text and "weights:" in text and "exit codes:" in text
    assert "--float32-weights" in text and "--calibrate" in text


def test_float8_is_named_wherever_targets_are() -> None:
    """No help text lists the targets without float8."""
    texts = [help_of(), *(help_of(command) for command in COMMANDS)]
    assert "float16, bfloat16 or float8" in texts[0]
    for text in texts:
        assert "float16 or bfloat16" not in " ".join(text.split()), text
    for command, text in zip(COMMANDS, texts[1:]):
        targets = "{float16,bfloat16,float8,float32}" if command == "convert" else "{float16,bfloat16,float8}"
        assert targets in text, command  # convert also takes a mixed model back to float32


@pytest.mark.parametrize("command", READ_ONLY)
def test_tag_set_help_of_commands_that_write_no_model_speaks_of_no_copy(command: str) -> None:
    def tag_set_help(text: str) -> str:
        return " ".join(text.split("  --tag-set TAGS", 1)[1].split("\n  --", 1)[0].split())

    assert "cop" not in tag_set_help(help_of(command)), tag_set_help(help_of(command))
    assert "copies the others" in tag_set_help(help_of("convert"))


# --------------------------------------------------------------------------------------
# 2. --calibrate takes a value, and a model is not one


def test_calibrate_before_the_paths_says_it_took_the_model_for_its_value(tmp_path: Path) -> None:
    model = tmp_path / "my_model"
    model.mkdir()
    line = error_line(run_cli("convert", "--calibrate", model, tmp_path / "out"))
    assert f"argument --calibrate: '{model}' is a model, not calibration data" in line, line
    assert "--calibrate random" in line and "required" not in line, line


@pytest.mark.parametrize("argv, value", [
    (["--calibrate", "random"], options.RANDOM_INPUTS),
    (["--calibrate"], options.RANDOM_INPUTS),                   # as before: nothing follows
    (["--calibrate", "--quiet"], options.RANDOM_INPUTS),        # as before: an option follows
    (["--calibrate", "calib.npz"], Path("calib.npz")),
    (["--calibrate=calib.npz"], Path("calib.npz")),
], ids=["random", "bare-last", "bare-before-option", "file", "file-with-equals"])
def test_calibrate_value_forms(argv: list[str], value: Path) -> None:
    args = options.build_parser().parse_args(options.with_calibrate_value(["convert", "src", "dst", *argv]))
    assert (args.src, args.dst, args.calibrate) == (Path("src"), Path("dst"), value)


# --------------------------------------------------------------------------------------
# 3. Names that are not there: the closest ones


def test_closest_names_match_the_last_path_components() -> None:
    names = ["sequential_1/dense_1/MatMul", "sequential_1/dense_1/BiasAdd", "sequential_1/conv2d_1/Conv2D",
             "saver_filename"]
    assert closest_names("dense/MatMul", names) == ["sequential_1/dense_1/MatMul"]
    assert closest_names("conv2d/Conv2D", names) == ["sequential_1/conv2d_1/Conv2D"]
    assert closest_names("saver_filenam", names) == ["saver_filename"]
    assert closest_names("softmax", names) == []
    # A deep scope: the whole names are too unlike (difflib.get_close_matches finds none); their tails are not.
    deep = ["model_1/transformer_block_1/feed_forward_1/dense_1/MatMul",
            "model_1/transformer_block_1/feed_forward_1/dense_1/BiasAdd"]
    assert closest_names("dense/MatMul", deep)[:1] == [deep[0]]


@pytest.fixture(scope="module")
def keras_sequential(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Keras 3 Sequential model exported as a SavedModel (its nodes are scoped, numbered)."""
    import keras

    keras.utils.set_random_seed(0)
    path = tmp_path_factory.mktemp("sequential") / "model"
    keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)]).export(
        str(path), verbose=False)
    return path


def test_explain_dense_matmul_suggests_the_exported_name(keras_sequential: Path) -> None:
    graph_def = savedmodel.read_model(keras_sequential).graph_def
    matmuls = sorted(node.name for function in graph_def.library.function for node in function.node_def
                     if node.op == "MatMul")
    first = next(name for name in matmuls if re.search(r"(^|/)dense(_\d+)*/MatMul$", name))
    assert first != "dense/MatMul", "the export kept Keras' layer name: nothing to suggest"
    line = error_line(run_cli("explain", keras_sequential, "dense/MatMul"))
    assert line.startswith(f"amp-rewrite: error: no node 'dense/MatMul'; did you mean '{first}'"), line
    assert "amp-rewrite dump" in line
    assert_ok(run_cli("explain", keras_sequential, first))  # the suggestion is a name explain takes


def test_unknown_function_and_fetch_suggest_the_closest(tmp_path: Path) -> None:
    source = write_graph_def(graph_def_with_deny_path(), tmp_path / "graph.pb")
    assert "allow1" in [node.name for node in graph_def_with_deny_path().node]
    line = error_line(run_cli("convert", source, tmp_path / "out.pb", "--fetch", "allow_1"))
    assert "--fetch allow_1: no such node in the graph; did you mean 'allow1'?" in line, line
    assert listing(tmp_path) == {"graph.pb"}
    line = error_line(run_cli("explain", source, "allow1", "--function", "(main grap)"))
    assert "did you mean '(main graph)'" in line, line


def test_a_missing_fetch_in_the_python_api_suggests_the_closest() -> None:
    with pytest.raises(GraphError, match=r"fetch node\(s\) 'allow_1' not in the graph; did you mean 'allow1'\?"):
        amp_rewrite.rewrite_graph_def(graph_def_with_deny_path(), fetches=["allow_1"])


def test_an_overlay_entry_naming_no_node_suggests_one(keras_sequential: Path) -> None:
    line = error_line(run_cli("inspect", keras_sequential, "--keep", "dense/MatMul"))
    assert re.search(r"\(e\.g\. 'dense/MatMul', did you mean '[^']*dense(_\d+)*/MatMul'", line), line


# --------------------------------------------------------------------------------------
# 4. One total per model, then the library's, labelled; "nodes" in the report


@pytest.fixture(scope="module")
def module_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("module") / "module"
    save_module(path)
    return path


def test_convert_prints_one_model_total_and_the_library_total_labelled(tmp_path: Path, module_model: Path) -> None:
    run = run_cli("convert", module_model, tmp_path / "out")
    assert_ok(run)
    model = savedmodel.read_model(module_model)
    report = savedmodel.rewrite_model(model, target="float16", lists=amp_rewrite.load_lists("float16")).report
    kinds = savedmodel.plumbing_kinds(model)
    own = [item for item in report.items if item.function not in kinds]
    totals = [line for line in run.out.splitlines() if re.search(r"[Cc]onverted \d+/\d+", line)]
    assert totals == [
        f"Model: converted {sum(i.vertices_converted for i in own)}/{sum(i.nodes_before for i in own)} nodes to"
        f" float16 using {sum(i.casts_to_target for i in own)} cast(s) to float16 (excluding Const and Variable"
        " casts)",
        "Library total, TensorFlow's plumbing included (as grappler's log counts): converted"
        f" {report.vertices_converted}/{report.nodes_before} nodes",
    ], run.out
    assert sum(i.nodes_before for i in own) < report.nodes_before  # two different totals, each labelled


def test_report_says_nodes_and_labels_the_library_total(tmp_path: Path, module_model: Path) -> None:
    assert_ok(run_cli("dump", module_model, tmp_path / "dump"))
    page = (tmp_path / "dump" / "report.html").read_text(encoding="utf-8")
    text = re.sub(r"<script.*?</script>|<style.*?</style>|<svg.*?</svg>|<[^>]+>", " ", page, flags=re.DOTALL)
    assert not re.search(r"\bvert(ex|ices)\b", text), re.findall(r".{40}\bvert(?:ex|ices)\b.{40}", text)
    assert "<b>library total, TensorFlow's plumbing included</b>: Converted " in html.unescape(page)


# --------------------------------------------------------------------------------------
# 5. A model already in mixed precision


@pytest.fixture(scope="module")
def bfloat16_model(tmp_path_factory: pytest.TempPathFactory, module_model: Path) -> Path:
    path = tmp_path_factory.mktemp("bf16") / "module_bf16"
    assert_ok(run_cli("convert", module_model, path, "--target", "bfloat16"))
    return path


def test_converting_again_says_already_and_no_bare_zero_total(tmp_path: Path, bfloat16_model: Path) -> None:
    run = run_cli("convert", bfloat16_model, tmp_path / "again", "--target", "bfloat16")
    assert_ok(run)
    first = run.out.splitlines()[0]
    assert re.fullmatch(r"Model: already bfloat16: 0 nodes to convert \(\d+ node\(s\) compute in bfloat16\)",
                        first), run.out
    assert "Model: converted 0/" not in run.out


def test_inspect_says_already_too(bfloat16_model: Path) -> None:
    for quiet in ([], ["--quiet"]):
        run = run_cli("inspect", bfloat16_model, "--target", "bfloat16", *quiet)
        assert_ok(run)
        assert "Model: already bfloat16: 0 nodes to convert" in run.out and "Model: converted" not in run.out, run.out


def test_float16_on_a_bfloat16_model_retargets_it_saying_so_first(tmp_path: Path, bfloat16_model: Path) -> None:
    """Once refused ("is already mixed precision"); now back to float32 first, then float16."""
    run = run_cli("convert", bfloat16_model, tmp_path / "fp16", "--target", "float16")
    assert_ok(run)
    assert re.match(r"Model: retargeted from bfloat16: \d+ node\(s\) back to float32 first", run.out), run.out
    assert re.search(r"^Model: converted [1-9]\d*/\d+ nodes to float16", run.out, re.MULTILINE), run.out


def test_a_float32_model_is_not_already_mixed(module_model: Path) -> None:
    graph_def = savedmodel.read_model(module_model).graph_def
    assert steps.already_low(graph_def, amp_rewrite.load_lists("float16")) == {}
