"""Peak memory and time of ``amp-rewrite convert`` on models of any size (``make bench``).

1. Weights streamed: TF1 SavedModels of 0.5, 2 and 6 GB of float32 variables (a chain of
   4096x4096 MatMul+Relu layers, generated a layer at a time), each converted to bfloat16
   (default: weights stored low) as a user runs it, beside ``inspect --float32-weights``
   (the process's baseline: TensorFlow imported, the graphs loaded and rewritten, nothing
   written) and TensorFlow's own ``load`` + ``save`` of the same model (the v1 loader and
   ``Builder``, as the model is a TF1 one). Goal: peak RSS at most the baseline + 0.1x the
   variables, time at most TensorFlow's load + save. ``--validate 1`` is measured beside
   them: at most the baseline + the source and the result once each (1.5x the variables).
2. Larger than RAM: the same, with variables larger than this machine's memory (30 GB on a
   24 GB machine; ``--huge``), generated without building it in memory; converted only (no
   TensorFlow load + save can hold it), and ``--validate 1`` refused in one line.
3. Frozen GraphDefs (``--frozen``): the same chain with its kernels as ``Const`` nodes in
   one ``.pb``, written a node at a time; ``convert`` (every kernel stored bfloat16) beside
   ``inspect --float32-weights`` (the baseline: TensorFlow imported, the graph read and
   rewritten, nothing written) and protobuf's own parse + serialize of the file. Goal: peak
   RSS at most the baseline + 0.1x the constants.
4. Many variables: Keras MLPs of Dense + LayerNorm blocks (``--blocks``, 300 and 1,000),
   exported with ``model.export``; the weights step (``cli.weights.stored_weights``) against
   the whole conversion (read, rewrite, weights step) in one process. Goal: at most 10%.
   Beside it, as the issue measured it, ``convert`` against ``convert --float32-weights``
   (two processes: the difference is all that storing the weights low costs, the low
   checkpoint's writing included), and the floor of any step written in Python: reading
   every node's inputs once into a readers map, one copy of the GraphDef, and one dtype
   written on every variable op of the copy (what storing every variable low changes).

Every command runs in its own process; peak RSS is that process's (``os.wait4``). The disk
all of it needs is checked first: a shortage is one line, nothing written. Models are
written under ``--dir`` (default: a temporary directory) and deleted once measured. Prints a
markdown section for BENCHMARKS.md; exits 1 when a goal is missed.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_memory.py [--smoke] [--dir DIR]
"""
from __future__ import annotations

import argparse
import os
import platform
import runpy
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 4096                  # a layer's kernel: WIDTH x WIDTH float32 (64 MB)
SMOKE_WIDTH = 64
GB = 1e9
MEMORY_GOAL = 0.1             # peak RSS above the baseline, over the variables' bytes
VALIDATE_GOAL = 1.5           # --validate: the source and the result once each
WEIGHTS_STEP_GOAL = 0.10      # the weights step's share of the conversion


@dataclass(frozen=True)
class Run:
    seconds: float
    peak: int   # bytes
    code: int
    err: str
    out: str


ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}  # with cwd=ROOT: this checkout's code


def run(*command: object, forked: bool = False) -> Run:
    """One process, its wall time, peak RSS and output. ``forked`` (--smoke): a fork of this process
    runs the command instead of a new Python, its numbers meaningless; where TensorFlow is already
    imported (tests/test_tools.py's runner imports it before it forks this tool), the fork skips its
    import, 7 s of CPU per command, most of the smoke run's 12 commands."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if forked:
            pid = _fork(command[1:], out.fileno(), err.fileno())
        else:
            pid = subprocess.Popen([str(part) for part in command], stdout=out, stderr=err, env=ENV, cwd=ROOT).pid
        _, status, usage = os.wait4(pid, 0)
        texts = []
        for file in (out, err):
            file.seek(0)
            texts.append(file.read().decode(errors="replace"))
    return Run(time.perf_counter() - started, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status), texts[1],
               texts[0])


def _fork(arguments: tuple[object, ...], out: int, err: int) -> int:
    """``python ARGUMENTS`` (``-c SCRIPT ...`` or ``-m MODULE ...``) in a fork of this process: its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(ROOT)
        os.environ.update(ENV)
        flag, first, *rest = (str(part) for part in arguments)
        sys.argv, sys.path[0] = [flag if flag == "-c" else first, *rest], str(ROOT)  # as ``python -c/-m`` in ROOT
        try:
            if flag == "-c":
                exec(compile(first, "<string>", "exec"), {"__name__": "__main__"})
            else:
                runpy.run_module(first, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # the child's top level: shown as Python shows it, then exit 1
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


GENERATE = textwrap.dedent('''
    import sys, numpy as np, tensorflow as tf
    from pathlib import Path
    from tensorflow.core.protobuf import saved_model_pb2, tensor_bundle_pb2
    from amp_rewrite.calibration import bundle
    path, layers, width = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        h = x
        for i in range(layers):
            w = tf.compat.v1.get_variable(f"dense_{i}/kernel", [width, width],
                                          initializer=tf.compat.v1.zeros_initializer())
            h = tf.nn.relu(tf.matmul(h, w))
        y = tf.identity(h, name="y")
        saver = tf.compat.v1.train.Saver()
        meta = tf.compat.v1.train.export_meta_graph(graph=graph, saver_def=saver.as_saver_def())
        meta.signature_def["serving_default"].CopyFrom(
            tf.compat.v1.saved_model.predict_signature_def(inputs={"x": x}, outputs={"y": y}))
    meta.meta_info_def.tags.append("serve")
    (path / "variables").mkdir(parents=True)
    (path / "saved_model.pb").write_bytes(
        saved_model_pb2.SavedModel(saved_model_schema_version=1, meta_graphs=[meta]).SerializeToString())
    base = np.random.default_rng(0).standard_normal((width, width), dtype=np.float32) * 0.02
    prefix, scratch = path / "variables" / "variables", path / "variables" / "chunk"
    entries = {}
    with open(bundle.data_path(prefix, 0, 1), "wb") as out:
        for i in range(layers):  # a layer at a time, SaveV2's bytes appended to the one shard
            tf.raw_ops.SaveV2(prefix=str(scratch), tensor_names=[f"dense_{i}/kernel"], shape_and_slices=[""],
                              tensors=[base * np.float32(1 + i / layers)])
            for key, entry in bundle.read_index(scratch).entries.items():
                entry.offset += out.tell()
                entries[key] = entry
            data = bundle.data_path(scratch, 0, 1)
            out.write(data.read_bytes())
            data.unlink()
    bundle.index_path(scratch).unlink()
    header = tensor_bundle_pb2.BundleHeaderProto(num_shards=1)
    header.version.producer = 1
    bundle.index_path(prefix).write_bytes(bundle.index_bytes(bundle.Index(header, entries)))
''')

LOAD_SAVE = textwrap.dedent('''
    import sys, tensorflow as tf
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], sys.argv[1])
        builder = tf.compat.v1.saved_model.Builder(sys.argv[2])
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map=dict(meta.signature_def))
        builder.save()
''')

MLP = textwrap.dedent('''
    import sys, keras
    sys.setrecursionlimit(100_000)  # Keras walks a 1,000-block functional model recursively
    blocks, path = int(sys.argv[1]), sys.argv[2]
    inputs = keras.Input((64,))
    h = inputs
    for _ in range(blocks):
        h = keras.layers.LayerNormalization()(keras.layers.Dense(64)(h))
    keras.Model(inputs, h).export(path, verbose=False)
''')

FROZEN = textwrap.dedent('''
    import sys, numpy as np, tensorflow as tf
    from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, types_pb2
    from amp_rewrite.calibration.bundle import encode_varint
    path, layers, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    float32 = attr_value_pb2.AttrValue(type=types_pb2.DT_FLOAT)

    def node(name, op, inputs=(), **attrs):
        return node_def_pb2.NodeDef(name=name, op=op, input=list(inputs), attr={"T": float32, **attrs})

    base = np.random.default_rng(0).standard_normal((width, width), dtype=np.float32) * 0.02
    shape = attr_value_pb2.AttrValue(shape=tf.TensorShape([None, width]).as_proto())
    nodes = [node_def_pb2.NodeDef(name="x", op="Placeholder", attr={"dtype": float32, "shape": shape})]
    with open(path, "wb") as out:
        for i in range(layers + 1):  # a layer at a time: its kernel, MatMul and Relu
            for found in nodes:
                data = found.SerializeToString(deterministic=True)
                out.write(b"\\n" + encode_varint(len(data)) + data)
            h = "x" if i == 0 else f"dense_{i - 1}/Relu"
            if i == layers:
                break
            kernel = attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(base * np.float32(1 + i / layers)))
            nodes = [node_def_pb2.NodeDef(name=f"dense_{i}/kernel", op="Const",
                                          attr={"dtype": float32, "value": kernel}),
                     node(f"dense_{i}/MatMul", "MatMul", (h, f"dense_{i}/kernel")),
                     node(f"dense_{i}/Relu", "Relu", (f"dense_{i}/MatMul",))]
        data = node("y", "Identity", (h,)).SerializeToString(deterministic=True)
        out.write(b"\\n" + encode_varint(len(data)) + data)
        out.write(graph_pb2.GraphDef(versions={"producer": tf.version.GRAPH_DEF_VERSION}).SerializeToString())
''')

PROTOBUF = textwrap.dedent('''
    import sys
    from pathlib import Path
    from tensorflow.core.framework import graph_pb2
    graph_def = graph_pb2.GraphDef.FromString(Path(sys.argv[1]).read_bytes())
    Path(sys.argv[2]).write_bytes(graph_def.SerializeToString(deterministic=True))
''')

STEPS = textwrap.dedent('''
    import gc, sys, time
    from amp_rewrite.calibration.savedmodel import effective_lists, read_model, rewrite_model
    from amp_rewrite.cli import weights
    started = time.perf_counter()
    model = read_model(sys.argv[1])
    result = rewrite_model(model, target="bfloat16", lists=effective_lists("bfloat16"))
    before = time.perf_counter()
    weights.stored_weights(model, result, "bfloat16")
    after = time.perf_counter()
    gc.disable()  # as during the step
    graph_def = result.graph_def
    for nodes in [graph_def.node, *(function.node_def for function in graph_def.library.function)]:
        readers = {}
        for node in nodes:
            name = node.name
            for tensor in node.input:
                readers.setdefault(tensor, []).append(name)
    copy = type(graph_def)()
    copy.CopyFrom(graph_def)
    for nodes in [copy.node, *(function.node_def for function in copy.library.function)]:
        for node in nodes:
            if node.op in ("VarHandleOp", "ReadVariableOp", "AssignVariableOp"):
                node.attr["dtype"].type = node.attr["dtype"].type
    print(after - before, after - started, time.perf_counter() - after)
''')


def python(script: str, *args: object, forked: bool = False) -> Run:
    return run(sys.executable, "-c", script, *args, forked=forked)


def convert(source: Path, destination: Path, *flags: str, forked: bool = False) -> Run:
    found = run(sys.executable, "-m", "amp_rewrite", "convert", source, destination, "--target", "bfloat16",
                "--quiet", *flags, forked=forked)
    shutil.rmtree(destination, ignore_errors=True)
    return found


def check_disk(directory: Path, needed: float) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        print(f"bench_memory: {directory}: needs {needed / GB:.1f} GB of disk, {free / GB:.1f} GB free; nothing was"
              " written; pass --dir on a larger disk, or smaller --sizes/--huge", file=sys.stderr)
        sys.exit(2)


def _failed(label: str, found: Run) -> str:
    return f"{label} failed (exit {found.code}): {found.err.strip().splitlines()[-1] if found.err.strip() else ''}"


def generate(script: str, source: Path, size: float, width: int, what: str, forked: bool) -> tuple[int, int]:
    """A model of about ``size`` GB of float32 kernels written at ``source`` by ``script``: (layers, bytes)."""
    layers = max(1, round(size * GB / (width * width * 4)))
    generated = python(script, source, layers, width, forked=forked)
    if generated.code:
        raise SystemExit(_failed(what, generated))
    return layers, layers * width * width * 4


def inspect_baseline(source: Path, forked: bool) -> Run:
    """The baseline: TensorFlow imported, the graph read and rewritten, nothing written."""
    return run(sys.executable, "-m", "amp_rewrite", "inspect", source, "--target", "bfloat16", "--quiet",
               "--float32-weights", forked=forked)


def measure_size(directory: Path, size: float, width: int, huge: bool, smoke: bool = False) -> tuple[list[str], bool]:
    """Rows for one model size; whether its goals were met (``smoke``: no --validate 1, commands forked)."""
    source = directory / f"model-{size:g}GB"
    layers, variables = generate(GENERATE, source, size, width, "generating", smoke)
    try:
        baseline = inspect_baseline(source, smoke)
        ours = convert(source, directory / "out", forked=smoke)
        tf_own = None if huge else python(LOAD_SAVE, source, directory / "out", forked=smoke)
        shutil.rmtree(directory / "out", ignore_errors=True)
        validated = None if smoke else convert(source, directory / "out", "--validate", "1")
    finally:
        shutil.rmtree(source, ignore_errors=True)
    for label, found in (("inspect", baseline), ("convert", ours), ("load+save", tf_own)):
        if found is not None and found.code:
            raise SystemExit(_failed(label, found))
    above = (ours.peak - baseline.peak) / variables
    ok = above <= MEMORY_GOAL and (tf_own is None or ours.seconds <= tf_own.seconds)
    rows = [f"| {variables / GB:.2f} GB ({layers} layers) | {baseline.peak / GB:.2f} | {ours.peak / GB:.2f}"
            f" | {above:.3f}x | {ours.seconds:.1f} | "
            + (f"{tf_own.peak / GB:.2f} | {tf_own.seconds:.1f} | {ours.seconds / tf_own.seconds:.2f}x"
               if tf_own is not None else "(cannot fit) | | ")
            + f" | {_validated(validated, baseline, variables) if validated else '(not run)'} |"]
    if validated is not None and not huge and not validated.code:
        ok = ok and (validated.peak - baseline.peak) / variables <= VALIDATE_GOAL
    return rows, ok


def measure_frozen(directory: Path, size: float, width: int, smoke: bool = False) -> tuple[str, bool]:
    """The row of one frozen GraphDef; whether its goal was met (``smoke``: commands forked)."""
    source, destination = directory / f"frozen-{size:g}GB.pb", directory / "frozen-out.pb"
    layers, constants = generate(FROZEN, source, size, width, "generating the frozen graph", smoke)
    try:
        baseline = inspect_baseline(source, smoke)
        ours = convert(source, destination, forked=smoke)
        destination.unlink(missing_ok=True)
        protobuf = python(PROTOBUF, source, destination, forked=smoke)
    finally:
        source.unlink(missing_ok=True)
        destination.unlink(missing_ok=True)
    for label, found in (("inspect", baseline), ("convert", ours), ("protobuf", protobuf)):
        if found.code:
            raise SystemExit(_failed(label, found))
    above = (ours.peak - baseline.peak) / constants
    return (f"| {constants / GB:.2f} GB ({layers} layers) | {baseline.peak / GB:.2f} | {ours.peak / GB:.2f}"
            f" | {above:.3f}x | {ours.seconds:.1f} | {protobuf.peak / GB:.2f} | {protobuf.seconds:.1f} |",
            above <= MEMORY_GOAL)


def _validated(found: Run, baseline: Run, variables: int) -> str:
    if found.code == 2:
        return f"refused: `{found.err.strip().splitlines()[-1][:150]}`"
    return f"{found.peak / GB:.2f} GB ({(found.peak - baseline.peak) / variables:.2f}x), {found.seconds:.1f} s"


def measure_blocks(directory: Path, blocks: int, smoke: bool = False) -> tuple[str, bool]:
    source = directory / f"mlp-{blocks}"
    exported = python(MLP, blocks, source, forked=smoke)
    if exported.code:
        raise SystemExit(_failed("exporting the MLP", exported))
    try:
        found = python(STEPS, source, forked=smoke)
        low = convert(source, directory / "out", forked=smoke)
        float32 = convert(source, directory / "out", "--float32-weights", forked=smoke)
    finally:
        shutil.rmtree(source, ignore_errors=True)
    for label, ran in (("the weights step", found), ("convert", low), ("convert --float32-weights", float32)):
        if ran.code:
            raise SystemExit(_failed(label, ran))
    step, total, floor = map(float, found.out.split()[-3:])
    share = step / total
    return (f"| {blocks} | {step:.2f} | {total:.2f} | {share:.1%} | {floor:.2f} ({floor / total:.1%}) |"
            f" {low.seconds:.1f} | {float32.seconds:.1f} | {(low.seconds - float32.seconds) / low.seconds:.1%} |",
            share <= WEIGHTS_STEP_GOAL)


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    found = [flag for flag in ("avx512f", "avx512_bf16", "amx_bf16") if f" {flag}" in flags]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    return f"CPU: {model} ({os.cpu_count()} cores; {', '.join(found) or 'no avx512'}); {memory:.0f} GB of memory"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models, seconds, under a temporary directory")
    parser.add_argument("--dir", type=Path, help="where models are written (default: a temporary directory)")
    parser.add_argument("--sizes", default="0.5,2,6", help="GB of variables, comma-separated")
    parser.add_argument("--huge", type=float, default=30, help="GB of variables beyond RAM (0: skip)")
    parser.add_argument("--frozen", default="", metavar="SIZES",
                        help="GB of Const weights of frozen GraphDef .pb files, comma-separated (default: none)")
    parser.add_argument("--blocks", default="300,1000", help="Dense+LayerNorm blocks of each MLP, comma-separated")
    args = parser.parse_args()
    width = SMOKE_WIDTH if args.smoke else WIDTH
    sizes = [0.00004] if args.smoke else [float(size) for size in args.sizes.split(",") if size]  # 2 layers
    huge = 0 if args.smoke else args.huge  # smoke: 6 processes
    frozen = [0.00004] if args.smoke else [float(size) for size in args.frozen.split(",") if size]
    blocks = [2] if args.smoke else [int(count) for count in args.blocks.split(",") if count and int(count)]
    if args.dir is not None and not args.smoke:
        args.dir = args.dir.resolve()  # the commands run in the checkout (cwd=ROOT)
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_memory.", dir=None if args.smoke else args.dir) as scratch:
        directory = Path(scratch)
        check_disk(directory, max([*sizes, huge, *frozen]) * GB * 1.6)  # the source, the result and a margin
        print(f"## Converting models of any size (CPU)\n\n{cpu_line()}; run {time.strftime('%Y-%m-%d')}, by"
              " `tools/bench_memory.py`.\n")
        print("| variables | baseline peak (GB) | convert peak (GB) | above baseline / variables | convert (s) |"
              " load+save peak (GB) | load+save (s) | convert / load+save | `--validate 1` peak |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        ok = True
        for size, is_huge in [*((size, False) for size in sizes), *(((huge, True),) if huge else ())]:
            rows, met = measure_size(directory, size, width, is_huge, args.smoke)
            print(*rows, sep="\n", flush=True)
            ok = ok and met
        if frozen:
            print("\n| constants (frozen .pb) | baseline peak (GB) | convert peak (GB) | above baseline / constants"
                  " | convert (s) | protobuf parse+write peak (GB) | protobuf (s) |")
            print("|---|---:|---:|---:|---:|---:|---:|")
        for size in frozen:
            row, met = measure_frozen(directory, size, width, args.smoke)
            print(row, flush=True)
            ok = ok and met
        if blocks:
            print("\n| MLP blocks | weights step (s) | conversion (s) | weights step share | floor (s, share) |"
                  " `convert` (s) | `--float32-weights` (s) | their difference / `convert` |"
                  "\n|---:|---:|---:|---:|---:|---:|---:|---:|")
        for count in blocks:
            row, met = measure_blocks(directory, count, args.smoke)
            print(row, flush=True)
            ok = ok and met
    print(f"\nGoals: peak at most baseline + {MEMORY_GOAL}x the variables, convert at most load+save, --validate at"
          f" most baseline + {VALIDATE_GOAL}x, a frozen graph's at most baseline + {MEMORY_GOAL}x its constants, the"
          f" weights step at most {WEIGHTS_STEP_GOAL:.0%}:"
          f" {'met' if ok else 'MISSED'}.")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
