"""Print the four op lists that the installed TensorFlow's grappler AMP pass really uses.

Runs the real pass once per target on a tiny MatMul graph with
``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LOG_PATH`` set and reads back the
``paintbuckets_AutoMixedPrecision_*.txt`` file it writes (spec §4, harness in §8):

* float16: CUDA mode on a virtual GPU (architecture 8.0, cuda 12050, cudnn 90300),
  so every cuda/cudnn gate of ``AutoMixedPrecisionListsFp16`` is open;
* bfloat16: oneDNN bf16 mode (``AutoMixedPrecisionListsMkl``).

Use it to re-check ``lists/*.yaml`` on a new TensorFlow version::

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/dump_grappler_lists.py [float16|bfloat16] [--yaml]

``tests/test_lists.py`` imports :func:`dump_lists` as its reference.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from amp_rewrite.core.target import TARGETS, lookup_target

if TYPE_CHECKING:
    from tensorflow.core.protobuf.meta_graph_pb2 import MetaGraphDef

# Section headers of the paintbuckets file -> our list names.
HEADER_TO_LIST = {"AllowList:": "allow", "DenyList:": "deny", "InferList:": "infer", "ClearList:": "clear"}
ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
GPU_NAME = "/job:localhost/replica:0/task:0/device:GPU:0"
GPU_ENVIRONMENT = {"architecture": "8.0", "cuda": "12050", "cudnn": "90300"}


@contextlib.contextmanager
def _grappler_environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Replace every TF_AUTO_MIXED_PRECISION_* variable by ``extra`` for the block."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    for key in saved:
        del os.environ[key]
    os.environ.update(extra)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
            del os.environ[key]
        os.environ.update(saved)


def _meta_graph_def() -> MetaGraphDef:
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
        y = tf.linalg.matmul(x, x, name="allow1")
        out = tf.identity(y, name="out")
        graph.add_to_collection("train_op", out)
        return tf.compat.v1.train.export_meta_graph()


def _virtual_gpu_cluster():  # -> tensorflow.python.grappler.cluster.Cluster
    from tensorflow.core.protobuf.device_properties_pb2 import DeviceProperties, NamedDevice

    from amp_rewrite import _tf

    gpu = NamedDevice(name=GPU_NAME, properties=DeviceProperties(type="GPU", environment=GPU_ENVIRONMENT))
    return _tf.GRAPPLER_CLUSTER.get()(devices=[gpu])


def parse_paintbuckets(text: str) -> dict[str, tuple[str, ...]]:
    """Parse a paintbuckets file into list name -> sorted op names (empty names kept)."""
    name_to_ops: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.split("\n"):
        if line in HEADER_TO_LIST:
            current = name_to_ops.setdefault(HEADER_TO_LIST[line], [])
        elif current is not None and line:
            current.append(line)
    missing = sorted(set(HEADER_TO_LIST.values()) - set(name_to_ops))
    if missing:
        raise RuntimeError(f"paintbuckets file lacks the lists {missing}: {text[:200]!r}")
    return {name: tuple(sorted(ops)) for name, ops in name_to_ops.items()}


def dump_lists(target: str, environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """Run grappler's AMP pass for ``target`` and return the lists it built.

    ``environ`` replaces the TF_AUTO_MIXED_PRECISION_* variables for the run (other
    variables are untouched), so list edits can be compared with TensorFlow itself.
    Raises ``GrapplerUnavailable`` where the pass cannot run on this machine and
    RuntimeError if the pass wrote no dump (it refused the variables or failed).
    """
    optimizer = lookup_target(target).grappler_optimizer
    from amp_rewrite.testing.reference import GrapplerUnavailable, unavailable_reason

    if unavailable_reason(target) is not None:
        raise GrapplerUnavailable(unavailable_reason(target))
    from tensorflow.core.protobuf import config_pb2

    from amp_rewrite import _tf

    _tf.require(_tf.ORACLE)
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.optimizers.append(optimizer)
    config.graph_options.rewrite_options.min_graph_nodes = -1
    cluster = _virtual_gpu_cluster() if target == "float16" else None
    with tempfile.TemporaryDirectory(prefix="amp_lists_") as log_dir:
        with _grappler_environ({**(environ or {}), ENV_PREFIX + "LOG_PATH": log_dir}):
            _tf.OPTIMIZE_GRAPH.get()(config, _meta_graph_def(), cluster=cluster, strip_default_attributes=False)
        dumps = sorted(Path(log_dir).glob("paintbuckets_AutoMixedPrecision_*.txt"))
        if not dumps:
            raise RuntimeError(
                f"grappler wrote no paintbuckets file for {target} (pass exited early or failed; "
                "run with TF_CPP_MIN_LOG_LEVEL=0 to see why)"
            )
        return parse_paintbuckets(dumps[0].read_text(encoding="utf-8"))


def _print_plain(target: str, name_to_ops: Mapping[str, tuple[str, ...]]) -> None:
    for name in ("allow", "deny", "infer", "clear"):
        ops = name_to_ops[name]
        print(f"[{target}] {name} ({len(ops)}):")
        for op in ops:
            print(f"  {op}")


def _print_yaml_ops(target: str, name_to_ops: Mapping[str, tuple[str, ...]]) -> None:
    print(f"# {target}")
    for name in ("allow", "deny", "infer", "clear"):
        print(f"{name}:\n  ops:")
        for op in name_to_ops[name]:
            print(f"    {op}:")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", metavar="TARGET", help="float16 and/or bfloat16 (default: both)")
    parser.add_argument("--yaml", action="store_true", help="print YAML 'ops:' skeletons instead of plain lists")
    parser.add_argument("--smoke", action="store_true",
                        help="checks this script: float16's lists (a virtual GPU: any CPU), each one non-empty")
    args = parser.parse_args(argv)
    if args.smoke:
        name_to_ops = dump_lists("float16")
        print({name: len(ops) for name, ops in name_to_ops.items()})
        return 0 if all(name_to_ops.values()) and "MatMul" in name_to_ops["allow"] else 1
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown target(s) {unknown}; use one of {', '.join(TARGETS)}")
    from amp_rewrite.testing.reference import GrapplerUnavailable

    for target in args.targets or TARGETS:
        try:
            name_to_ops = dump_lists(target)
        except GrapplerUnavailable as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        (_print_yaml_ops if args.yaml else _print_plain)(target, name_to_ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
