"""Tests for amp_rewrite.core.lists: the built-in lists, overlays, TensorFlow's variables.

TensorFlow's own grappler pass is the reference: the built-in files and the
variable semantics are compared with its paintbuckets dump (tools/dump_grappler_lists.py).
"""
from __future__ import annotations

import copy as copy_module
import dataclasses
import pickle
import re
import warnings
from pathlib import Path

import pytest

import recorded_grappler
from amp_rewrite.core import lists as lists_module
from amp_rewrite.core.lists import ENV_PREFIX as P
from amp_rewrite.core.lists import Colour, OpLists, held_float32, load_float8, load_lists
from amp_rewrite.core.target import TARGETS
from amp_rewrite.errors import ListsError
from amp_rewrite.testing.reference import held_float32_ops

ROOT = Path(__file__).resolve().parent.parent
LISTS = ("allow", "deny", "infer", "clear")
# Registered TensorFlow ops that are in no built-in list: safe to add without a warning.
FREE_OPS = ("Cumsum", "Cumprod")
# One built-in member per list, the same for both targets.
MEMBER = {"allow": "MatMul", "deny": "Exp", "infer": "Add", "clear": "Relu"}


@pytest.fixture(scope="module")
def grappler_lists():
    """The lists TensorFlow's grappler pass builds for each target, with no variables set."""
    return {target: recorded_grappler.lists(target) for target in TARGETS}


def lists_of(op_lists: OpLists) -> dict[str, frozenset[str]]:
    return {name: getattr(op_lists, name) for name in LISTS}


def write(tmp_path: Path, text: str, name: str = "my.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- built-in lists -------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_builtin_lists_equal_grappler_dump(target, grappler_lists):
    """lists/<target>.yaml holds exactly what the installed TensorFlow's pass uses, less
    the ops of its float32 section, which grappler has on its infer list."""
    if grappler_lists[target] is None:
        recorded_grappler.skip_comparison()
    ours = load_lists(target, environ={})
    for name in LISTS:
        theirs = frozenset(grappler_lists[target][name])
        if name == "infer":
            theirs -= held_float32_ops(target)
        assert getattr(ours, name) == theirs, (
            f"{target} {name}: only in YAML {sorted(getattr(ours, name) - theirs)}, "
            f"only in grappler {sorted(theirs - getattr(ours, name))}; re-run tools/dump_grappler_lists.py"
        )


@pytest.mark.parametrize(
    ("target", "sizes", "held"),
    [("float16", {"allow": 39, "deny": 9, "infer": 43, "clear": 110}, 0),
     ("bfloat16", {"allow": 14, "deny": 7, "infer": 42, "clear": 111}, 6)],
)
def test_builtin_sizes_are_tf_2_21(target, sizes, held):
    """Sizes as TF 2.21 builds them (spec §3), infer less the ops we hold float32."""
    assert {name: len(ops) for name, ops in lists_of(load_lists(target, environ={})).items()} == sizes
    assert len(held_float32(target)) == held


def test_held_float32_ops_are_in_no_list_with_a_reason():
    """bfloat16's float32 section: grappler's infer ops that run slower converted on a CPU
    are in no list and say why; an overlay or variable can still list them."""
    bf16 = load_lists("bfloat16", environ={})
    assert {"Erfc", "Elu", "Selu", "Softplus"} <= held_float32("bfloat16")
    for op in held_float32("bfloat16"):
        assert bf16.colour(op) is None
        assert "bfloat16 kernel takes" in bf16.reasons[op]
    put_back = load_lists("bfloat16", environ={P + "INFERLIST_ADD": "Erfc"})
    assert put_back.colour("Erfc") is Colour.INFER and "Erfc" not in put_back.reasons
    assert load_lists("bfloat16", environ={P + "DENYLIST_ADD": "Elu"}).colour("Elu") is Colour.DENY


def test_builtin_file_holding_a_listed_op_is_refused(tmp_path, monkeypatch):
    """An op in the float32 section and in a list is a broken file, named with the fix."""
    text = (ROOT / "lists" / "bfloat16.yaml").read_text(encoding="utf-8")
    (tmp_path / "bfloat16.yaml").write_text(text.replace("    Selu: its", "    Mul: its"), encoding="utf-8")
    monkeypatch.setattr(lists_module, "_BUILTIN_DIR", tmp_path)
    with pytest.raises(ListsError, match=r"bfloat16.yaml: op 'Mul' is in both 'infer' and 'float32'; restore"):
        load_lists("bfloat16", environ={})


def test_colour_reads_the_lists():
    """colour() names the list an op is in; Mean/Sum differ between the targets."""
    fp16, bf16 = load_lists("float16", environ={}), load_lists("bfloat16", environ={})
    assert [fp16.colour(op) for op in ("MatMul", "Exp", "Add", "Relu", "Cumsum")] == [
        Colour.ALLOW, Colour.DENY, Colour.INFER, Colour.CLEAR, None]
    assert fp16.colour("Mean") is Colour.DENY and bf16.colour("Mean") is Colour.INFER
    assert fp16.colour("Sum") is Colour.DENY and bf16.colour("Sum") is Colour.INFER
    assert bf16.colour("While") is Colour.CLEAR and fp16.colour("While") is None


def test_reasons_come_from_the_yaml():
    """Non-obvious entries carry a reason; obvious ones none; the mapping is read-only."""
    fp16, bf16 = load_lists("float16", environ={}), load_lists("bfloat16", environ={})
    assert "bfloat16" in fp16.reasons["Mean"] and "float16" in bf16.reasons["Mean"]
    assert "not a public" in fp16.reasons["Mha"]
    assert "MatMul" not in fp16.reasons
    with pytest.raises(TypeError):
        fp16.reasons["MatMul"] = "x"  # type: ignore[index]


def test_builtin_lists_do_not_warn():
    """Built-in entries that TensorFlow does not register (Mha, Tmlp, ...) never warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for target in TARGETS:
            load_lists(target, environ={})


def test_unknown_target_lists_allowed_values():
    """A bad target is a ValueError naming the allowed ones."""
    with pytest.raises(ValueError, match="unknown target 'float4'; use one of float16, bfloat16, float8"):
        load_lists("float4")


def test_an_overlay_holds_float8s_amax_and_lossy_matmuls(tmp_path):
    """Rule: ``amax`` (tensor -> largest |x|) and ``lossy`` (matmul -> why) are read by
    load_float8 with FUNCTION:: scopes; load_lists leaves them to it, and both refuse bad ones."""
    path = write(tmp_path, 'keep_nodes: [head]\namax: {"x:0": 3.5, "f::dense/Relu:0": 2}\n'
                           'lossy: {"f::dense/MatMul": "calibration: drifted 0.9"}\n')
    found = load_float8(path)
    assert dict(found.amax) == {("", "x", 0): 3.5, ("f", "dense/Relu", 0): 2.0}
    assert dict(found.lossy) == {("f", "dense/MatMul"): "calibration: drifted 0.9"}
    assert load_lists("float8", path, environ={}).keep_nodes == ("head",)
    assert load_float8(write(tmp_path, "keep_nodes: [head]\n", "plain.yaml")) is None
    for text, message in [('amax: {"x": 1.0}', "amax key 'x' is not FUNCTION::node:port or node:port"),
                          ('amax: {"^x:0": 1.0}', "amax key '^x:0' is not FUNCTION::node:port or node:port"),
                          ('amax: {"x:0": -1}', "amax 'x:0' is -1, not the largest"),
                          ('amax: {"x:0": .nan}', "amax 'x:0' is nan"),
                          ('lossy: {"m": "why"}', "'lossy' without 'amax'"),
                          ('amax: {}\nlossy: {"m:0": "why"}', "a node name has no ':'")]:
        bad = write(tmp_path, text + "\n", "bad.yaml")
        with pytest.raises(ListsError, match=re.escape(message)):
            load_float8(bad)
        with pytest.raises(ListsError, match=re.escape(message)):
            load_lists("float16", bad, environ={})


def test_float8_colours_with_float16s_lists():
    """float8 is the float16 rewrite plus a step: its lists are float16's, overlay and all."""
    assert load_lists("float8", environ={}) is load_lists("float16", environ={})
    assert load_lists("float8", environ={}).target == "float16"


def test_oplists_overlay_is_returned_as_is():
    """An OpLists is already loaded: returned unchanged, but its target must match."""
    lists = load_lists("float16", environ={})
    assert load_lists("float16", lists, environ={P + "ALLOWLIST_ADD": "Cumsum"}) is lists
    with pytest.raises(ListsError, match="for 'float16', not 'bfloat16'"):
        load_lists("bfloat16", lists)


def test_oplists_is_a_frozen_validated_value():
    """OpLists is hashable and frozen; replace() re-validates; an op in two lists is refused."""
    lists = OpLists("float16", frozenset({"MatMul"}), frozenset({"Exp"}), frozenset(), frozenset())
    assert hash(lists) == hash(dataclasses.replace(lists)) and lists == dataclasses.replace(lists)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lists.force_all = True  # type: ignore[misc]
    with pytest.raises(ListsError, match="op 'MatMul' is in both 'allow' and 'deny'; remove it from one"):
        dataclasses.replace(lists, deny=frozenset({"MatMul"}))
    assert "allow=1 ops" in repr(lists)


def test_oplists_copies_and_pickles():
    """deepcopy and pickle give an equal value with the same reasons and keep_nodes."""
    lists = dataclasses.replace(load_lists("float16", environ={}), keep_nodes=("head/.*",))
    for copy in (copy_module.deepcopy(lists), pickle.loads(pickle.dumps(lists))):
        assert copy == lists and copy.reasons == lists.reasons and copy.keeps("head/x")


# --- overlay files --------------------------------------------------------------------------


def test_overlay_adds_and_removes(tmp_path):
    """add then remove per list; a moved op loses its built-in reason; the file is a source."""
    path = write(tmp_path, "allow: {add: [Cumsum, Mean]}\ndeny: {remove: [Mean, Exp]}\nclear: {add: [Cumprod]}\n")
    lists = load_lists("float16", path, environ={})
    assert lists.colour("Cumsum") is Colour.ALLOW and lists.colour("Mean") is Colour.ALLOW
    assert lists.colour("Exp") is None and lists.colour("Cumprod") is Colour.CLEAR
    assert "Mean" not in lists.reasons
    assert lists.sources == (str(ROOT / "amp_rewrite" / "lists" / "float16.yaml"), str(path))  # the package data


def test_overlay_add_before_remove(tmp_path):
    """Within one list, remove wins over add (applied second)."""
    lists = load_lists("float16", write(tmp_path, "infer: {add: [Cumsum], remove: [Cumsum, Add]}\n"), environ={})
    assert lists.colour("Cumsum") is None and lists.colour("Add") is None


def test_empty_overlay_changes_nothing(tmp_path):
    """An empty file, or empty sections, edit nothing."""
    builtin = load_lists("bfloat16", environ={})
    for text in ("", "allow:\nkeep_nodes:\n", "deny: {add: [], remove: []}\n"):
        assert lists_of(load_lists("bfloat16", write(tmp_path, text), environ={})) == lists_of(builtin)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("allow: {add: [MatMul]\n", ["my.yaml:2: invalid YAML", "fix the syntax"]),
        ("allow: {add: [A]}\nallow: {add: [B]}\n", ["my.yaml:2:", "duplicate key 'allow'"]),
        ("- allow\n", ["my.yaml: the file must be a mapping"]),
        ("alow: {add: [Cumsum]}\n", ["my.yaml: unknown key 'alow'", "did you mean 'allow'",
                                     "allowed keys: allow, deny, infer, clear, keep_nodes"]),
        ("allow: {append: [Cumsum]}\n", ["my.yaml: unknown key 'append' under 'allow'", "allowed keys: add, remove"]),
        ("allow: [Cumsum]\n", ["my.yaml: 'allow' must be a mapping like {add: [Foo], remove: [Bar]}"]),
        ("allow: {add: Cumsum}\n", ["my.yaml: allow.add must be a list"]),
        ("deny: {remove: [Exp, 3]}\n", ["my.yaml: deny.remove[1] is int 3", "quote it or remove it"]),
        ("clear: {add: [yes]}\n", ["my.yaml: clear.add[0] is bool True"]),
        ("keep_nodes: [logits, 7]\n", ["my.yaml: keep_nodes[1] is int 7"]),
        ("keep_nodes: ['model/(']\n", ["my.yaml: keep_nodes[0] 'model/(' is not a valid regular expression"]),
        ("keep_nodes: logits\n", ["my.yaml: keep_nodes must be a list like", "or a mapping like {logits: reason}"]),
        ("keep_nodes: {logits: 7}\n", ["my.yaml: keep_nodes entry 'logits' has reason 7 (int), not one line",
                                       "quote it on one line"]),
        ("keep_nodes: {logits: }\n", ["my.yaml: keep_nodes entry 'logits' has reason None", 'write "" for none']),
        ("keep_nodes: {logits: [big]}\n", ["my.yaml: keep_nodes entry 'logits' has reason ['big'] (list)"]),
        ("keep_nodes: {logits: \"two\\nlines\"}\n", ["my.yaml: keep_nodes entry 'logits' has reason 'two\\nlines'"]),
        ("keep_nodes: {7: overflow}\n", ["my.yaml: keep_nodes key 7 is int, not a node name or regex; quote it"]),
        ("keep_nodes: {'model/(': why}\n", ["my.yaml: keep_nodes entry 'model/(' is not a valid regular expression"]),
        ("keep_nodes: ['::dense']\n", ["my.yaml: keep_nodes[0] '::dense' has nothing before '::'",
                                       "write FUNCTION::PATTERN"]),
        ("keep_nodes: {'f::': why}\n", ["my.yaml: keep_nodes entry 'f::' has nothing after '::'"]),
        ("deny: {add: [MatMul]}\n",
         ["my.yaml: op 'MatMul' is in both 'allow' and 'deny'", "'allow' from lists/float16.yaml",
          "remove it from one", "allow: {remove: [MatMul]}"]),
        ("allow: {add: [Cumsum]}\nclear: {add: [Cumsum]}\n",
         ["my.yaml: op 'Cumsum' is in both 'allow' and 'clear'; remove it from one"]),
    ],
)
def test_overlay_rejections_say_file_key_and_fix(tmp_path, text, expected):
    """Each bad overlay is a one-line ListsError naming the file, the key or op, and what to do."""
    with pytest.raises(ListsError) as caught:
        load_lists("float16", write(tmp_path, text), environ={})
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "my.yaml"))
    for part in expected:
        assert part in message


def test_missing_overlay_file(tmp_path):
    """A path that does not exist is a ListsError, not an OSError."""
    with pytest.raises(ListsError, match="nope.yaml: cannot read the lists file"):
        load_lists("float16", tmp_path / "nope.yaml", environ={})


def test_overlay_unknown_ops_warn_once(tmp_path):
    """Ops an overlay adds that TensorFlow does not register: one warning listing them all."""
    path = write(tmp_path, "allow: {add: [MyFusedOp, Cumsum]}\nclear: {add: [MyCopy]}\n")
    with pytest.warns(UserWarning) as record:
        lists = load_lists("float16", path, environ={})
    assert len(record) == 1
    message = str(record[0].message)
    assert "'MyCopy'" in message and "'MyFusedOp'" in message and "Cumsum" not in message
    assert lists.colour("MyFusedOp") is Colour.ALLOW


# --- keep_nodes -----------------------------------------------------------------------------


def test_keep_nodes_match_names_and_regexes(tmp_path):
    """Entries are node names or regexes matched against the whole node name."""
    lists = load_lists("float16", write(tmp_path, "keep_nodes: [logits, 'model/head/.*', 'dense_\\d+']\n"), environ={})
    assert lists.keep_nodes == ("logits", "model/head/.*", "dense_\\d+")
    assert [lists.keeps(name) for name in ("logits", "model/head/dense/MatMul", "dense_12")] == [True] * 3
    assert [lists.keeps(name) for name in ("logits_1", "x/logits", "model/body/x", "dense_", "dense_1x")] == [False] * 5
    assert not load_lists("float16", environ={}).keeps("logits")


def test_keep_nodes_mapping_gives_each_entry_a_reason(tmp_path):
    """The mapping form: entry -> one-line reason, in file order; "" gives none."""
    text = ('keep_nodes:\n  model/dense/MatMul: "calibration: output 0 reached 2.1e+05"\n'
            '  "__inference_call_123::dense_1/BiasAdd": ""\n')
    lists = load_lists("float16", write(tmp_path, text), environ={})
    assert lists.keep_nodes == ("model/dense/MatMul", "__inference_call_123::dense_1/BiasAdd")
    assert dict(lists.keep_reasons) == {"model/dense/MatMul": "calibration: output 0 reached 2.1e+05"}
    assert lists.keeps("model/dense/MatMul") and lists.keeps("dense_1/BiasAdd", "__inference_call_123")


def test_function_scoped_entry_keeps_nodes_of_that_function_only():
    """FUNCTION::PATTERN matches in the function named FUNCTION exactly, never in the main
    graph ("") or another function; an entry without '::' matches in every item."""
    lists = dataclasses.replace(load_lists("float16", environ={}), keep_nodes=("f::dense/.*", "logits"))
    assert lists.keep_entry("dense/MatMul", "f") == "f::dense/.*"
    assert lists.keep_entry("dense/MatMul") is None and lists.keep_entry("dense/MatMul", "g") is None
    assert lists.keep_entry("dense/MatMul", "f_1") is None and lists.keep_entry("f::dense/MatMul") is None
    assert [lists.keep_entry("logits", function) for function in ("", "f", "g")] == ["logits"] * 3


def test_keeping_adds_entries_with_reasons_to_new_lists():
    """``keeping`` returns new lists: entries appended in order, a repeated entry keeps its
    place and takes a new reason if one is given; the lists it was called on are unchanged."""
    builtin = load_lists("float16", environ={})
    first = builtin.keeping({"a/MatMul": "calibration: 7e+04", "b/.*": ""})
    second = first.keeping({"b/.*": "user: head stays float32", "a/MatMul": "", "f::c": ""})
    assert builtin.keep_nodes == () and not builtin.keep_reasons
    assert first.keep_nodes == ("a/MatMul", "b/.*") and dict(first.keep_reasons) == {"a/MatMul": "calibration: 7e+04"}
    assert second.keep_nodes == ("a/MatMul", "b/.*", "f::c")
    assert dict(second.keep_reasons) == {"a/MatMul": "calibration: 7e+04", "b/.*": "user: head stays float32"}
    assert second.keeps("c", "f") and not second.keeps("c")
    for copy in (copy_module.deepcopy(second), pickle.loads(pickle.dumps(second))):
        assert copy == second and copy.keep_reasons == second.keep_reasons


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ({"x(": ""}, "OpLists: keep_nodes[0] 'x(' is not a valid regular expression"),
        ({"x": "two\nlines"}, "OpLists: keep_reasons entry 'x' has reason 'two\\nlines' (str), not one line"),
        ({"x": 7}, "OpLists: keep_reasons entry 'x' has reason 7 (int)"),
    ],
)
def test_keeping_rejects_bad_entries_in_one_line(entries, expected):
    """Entries added in code are checked like an overlay's."""
    with pytest.raises(ListsError) as caught:
        load_lists("float16", environ={}).keeping(entries)
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)


# --- TensorFlow's environment variables -----------------------------------------------------

ENV_NAME_TO_LIST = {
    "ALLOWLIST": "allow", "WHITELIST": "allow",
    "INFERLIST": "infer", "GRAYLIST": "infer",
    "DENYLIST": "deny", "BLACKLIST": "deny",
    "CLEARLIST": "clear",
}


def test_builtin_lists_are_built_once_and_any_variable_builds_them_anew(monkeypatch):
    """With no overlay and no variable set every call returns the same lists; any of
    TensorFlow's variables, from ``environ`` or from ``os.environ``, is read again."""
    first = load_lists("float16", environ={})
    assert load_lists("float16", environ={}) is first
    variables = [P + "LEVEL"] + [f"{P}{name}_{action}" for name in ENV_NAME_TO_LIST for action in ("ADD", "REMOVE")]
    for var in variables:
        value = "TREAT_INFER_AS_DENY" if var.endswith("LEVEL") else "Cumsum"
        assert var in load_lists("float16", environ={var: value}).sources, var
    monkeypatch.setenv(P + "ALLOWLIST_ADD", "Cumsum")
    assert load_lists("float16").colour("Cumsum") is Colour.ALLOW
    monkeypatch.delenv(P + "ALLOWLIST_ADD")
    assert load_lists("float16") is first


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("env_name", ENV_NAME_TO_LIST)
def test_env_add_and_remove(target, env_name):
    """<LIST>_ADD adds to and <LIST>_REMOVE removes from the list, legacy names included."""
    name = ENV_NAME_TO_LIST[env_name]
    lists = load_lists(target, environ={f"{P}{env_name}_ADD": "Cumsum,Cumprod", f"{P}{env_name}_REMOVE": MEMBER[name]})
    assert {"Cumsum", "Cumprod"} <= getattr(lists, name)
    assert lists.colour(MEMBER[name]) is None
    assert f"{P}{env_name}_ADD" in lists.sources


def test_env_add_before_remove_and_legacy_after_new():
    """ADD is applied before REMOVE, and WHITELIST after ALLOWLIST (spec §4)."""
    def allow(env):
        return load_lists("float16", environ={P + key: value for key, value in env.items()}).allow
    assert "Cumsum" not in allow({"ALLOWLIST_ADD": "Cumsum", "ALLOWLIST_REMOVE": "Cumsum"})
    assert "Cumsum" in allow({"ALLOWLIST_REMOVE": "Cumsum", "WHITELIST_ADD": "Cumsum"})
    assert "Cumsum" not in allow({"ALLOWLIST_ADD": "Cumsum", "WHITELIST_REMOVE": "Cumsum"})


def test_env_values_are_not_trimmed():
    """'A, B' adds ' B' (TensorFlow does not trim), which is then reported as unknown."""
    with pytest.warns(UserWarning, match=f"' Cumprod' \\({P}ALLOWLIST_ADD\\)"):
        lists = load_lists("float16", environ={P + "ALLOWLIST_ADD": "Cumsum, Cumprod"})
    assert {"Cumsum", " Cumprod"} <= lists.allow and "Cumprod" not in lists.allow


def test_env_empty_pieces_add_the_empty_name():
    """'A,,B' adds A, B and the empty name: harmless alone, a conflict in two lists (as in TF)."""
    lists = load_lists("float16", environ={P + "ALLOWLIST_ADD": "Cumsum,,Cumprod,", P + "DENYLIST_ADD": ""})
    assert {"Cumsum", "Cumprod"} <= lists.allow and "" not in lists.allow
    with pytest.raises(ListsError, match="op '' .* is in both 'allow' and 'deny'.*remove the extra comma"):
        load_lists("float16", environ={P + "ALLOWLIST_ADD": "Cumsum,", P + "DENYLIST_ADD": "Cumprod,"})


def test_env_conflict_names_op_lists_and_variable():
    """Adding an op that is in another list fails; the message says how to move it."""
    with pytest.raises(ListsError) as caught:
        load_lists("bfloat16", environ={P + "WHITELIST_ADD": "Exp"})
    assert str(caught.value) == (
        f"{P}WHITELIST_ADD: op 'Exp' is in both 'allow' and 'deny' ('deny' from lists/bfloat16.yaml); "
        f"remove it from one (to move it, also set {P}DENYLIST_REMOVE=Exp)"
    )
    moved = load_lists("bfloat16", environ={P + "WHITELIST_ADD": "Exp", P + "DENYLIST_REMOVE": "Exp"})
    assert moved.colour("Exp") is Colour.ALLOW and "Exp" not in moved.reasons


def test_env_applies_after_overlay(tmp_path):
    """Order: built-in, overlay, variables."""
    path = write(tmp_path, "allow: {add: [Cumsum]}\n")
    assert load_lists("float16", path, environ={P + "ALLOWLIST_REMOVE": "Cumsum"}).colour("Cumsum") is None


def test_environ_defaults_to_os_environ(monkeypatch):
    """Without environ=, the process environment is read."""
    monkeypatch.setenv(P + "CLEARLIST_ADD", "Cumsum")
    assert load_lists("bfloat16").colour("Cumsum") is Colour.CLEAR


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("level", ["TREAT_INFER_AS_DENY", "treat_infer_as_deny"])
def test_level_treat_infer_as_deny(target, level):
    """Infer ops (after edits) join deny; infer is empty."""
    builtin = load_lists(target, environ={})
    lists = load_lists(target, environ={P + "LEVEL": level, P + "INFERLIST_ADD": "Cumsum"})
    assert lists.infer == frozenset()
    assert lists.deny == builtin.deny | builtin.infer | {"Cumsum"}
    assert (lists.allow, lists.clear, lists.force_all) == (builtin.allow, builtin.clear, False)


def test_level_tensor_cores_only_float16():
    """float16: infer/deny/clear empty before edits, so only allow edits count."""
    env = {P + "LEVEL": "Tensor_Cores_Only", P + "DENYLIST_ADD": "Cumsum", P + "ALLOWLIST_ADD": "Cumprod"}
    lists = load_lists("float16", environ=env)
    assert (lists.deny, lists.infer, lists.clear) == (frozenset(),) * 3
    assert lists.allow == load_lists("float16", environ={}).allow | {"Cumprod"}


def test_level_tensor_cores_only_bfloat16_has_no_effect():
    """bfloat16 (oneDNN lists) ignores TENSOR_CORES_ONLY; edits apply as usual."""
    lists = load_lists("bfloat16", environ={P + "LEVEL": "TENSOR_CORES_ONLY", P + "DENYLIST_ADD": "Cumsum"})
    assert lists_of(lists) == {**lists_of(load_lists("bfloat16", environ={})),
                               "deny": load_lists("bfloat16", environ={}).deny | {"Cumsum"}}


def test_level_unsafe_force_all():
    """float16: force_all, lists unchanged; bfloat16: refused as TensorFlow does with oneDNN."""
    lists = load_lists("float16", environ={P + "LEVEL": "unsafe_force_all"})
    assert lists.force_all and lists_of(lists) == lists_of(load_lists("float16", environ={}))
    with pytest.raises(ListsError, match="UNSAFE_FORCE_ALL is not supported for target 'bfloat16'.*unset it"):
        load_lists("bfloat16", environ={P + "LEVEL": "UNSAFE_FORCE_ALL"})


def test_unknown_level_warns_and_is_ignored():
    """TensorFlow ignores other values; we say so."""
    with pytest.warns(UserWarning, match="'FAST' is not one of"):
        lists = load_lists("float16", environ={P + "LEVEL": "FAST"})
    assert lists == load_lists("float16", environ={})


# --- variables against TensorFlow itself ----------------------------------------------------

LIVE_CASES = [
    ("float16", {"ALLOWLIST_ADD": "Cumsum, Cumprod,,", "WHITELIST_REMOVE": "Cumsum", "DENYLIST_REMOVE": "Exp",
                 "GRAYLIST_ADD": "Exp", "BLACKLIST_ADD": "Cumprod", "CLEARLIST_REMOVE": "Relu"}),
    ("bfloat16", {"ALLOWLIST_REMOVE": "MatMul", "WHITELIST_ADD": "MatMul,Cumsum", "INFERLIST_ADD": "Cumprod",
                  "GRAYLIST_REMOVE": "Add", "BLACKLIST_REMOVE": "Exp", "CLEARLIST_ADD": "Exp"}),
    ("float16", {"LEVEL": "tensor_cores_only", "DENYLIST_ADD": "Cumsum", "ALLOWLIST_ADD": "Cumprod"}),
    ("bfloat16", {"LEVEL": "tensor_cores_only", "DENYLIST_ADD": "Cumsum", "ALLOWLIST_ADD": "Cumprod"}),
    ("float16", {"LEVEL": "UNSAFE_FORCE_ALL"}),
    ("float16", {"ALLOWLIST_ADD": "Exp"}),
    ("bfloat16", {"ALLOWLIST_ADD": "Cumsum,", "DENYLIST_ADD": "Cumprod,"}),
    ("bfloat16", {"LEVEL": "UNSAFE_FORCE_ALL"}),
    ("bfloat16", {"INFERLIST_ADD": "Erfc", "DENYLIST_ADD": "Elu", "GRAYLIST_ADD": "Selu",
                  "INFERLIST_REMOVE": "Add"}),
    ("bfloat16", {"CLEARLIST_ADD": "Softplus", "INFERLIST_REMOVE": "Erfc"}),
]


@pytest.mark.parametrize(("target", "env"), LIVE_CASES)
def test_env_semantics_match_grappler(target, env):
    """With the same variables, grappler builds the same lists, or fails where we raise."""
    environ = {P + key: value for key, value in env.items()}
    refused = False
    try:
        theirs = recorded_grappler.lists(target, environ, our_lists=True)
    except recorded_grappler.ListsRefused:  # grappler refused the lists and wrote no dump
        refused = True
    else:
        if theirs is None:
            recorded_grappler.skip_comparison()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ' Cumprod' is reported as unknown; not under test here
        if refused:
            with pytest.raises(ListsError):
                load_lists(target, environ=environ)
            return
        ours = load_lists(target, environ=environ)
    assert {name: frozenset(ops) for name, ops in theirs.items()} == lists_of(ours)
