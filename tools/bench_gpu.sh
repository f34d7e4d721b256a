#!/usr/bin/env bash
# Float16 end-to-end benchmark on one NVIDIA GPU (compute capability 7.0+): float32, ours
# (amp_rewrite.mixed_precision(target="float16")), grappler's auto_mixed_precision and Keras'
# mixed_float16 policy, on ResNet50 and the BERT-base-shaped encoder, inference and one
# training step; then serving converted SavedModels (tools/bench_serving.py). Prints the
# tables and replaces the gpu-float16 and gpu-float16-serving sections of BENCHMARKS.md. Not
# run by CI. tools/bench.py's part takes under five minutes (small run counts); the serving
# part is not yet timed on a GPU (18 min on a 2-core CPU, mostly exports, conversions and
# fresh-process loads); installing TensorFlow the first time takes longer.
#
#   tools/bench_gpu.sh                          # pip install from the index and the local pip cache
#   WHEELS=/path/to/wheels tools/bench_gpu.sh   # offline: pip --no-index --find-links "$WHEELS"
#
# WHEELS must hold wheels for this machine's Python and platform of tensorflow[and-cuda]
# (2.16-2.21) and all its dependencies (the nvidia-* CUDA wheels too), networkx, pyyaml,
# protobuf, tqdm, and setuptools and wheel to build this package. Fill it on a connected
# machine with the same Python:
#   pip download -d wheels 'tensorflow[and-cuda]>=2.16,<2.22' networkx pyyaml protobuf tqdm setuptools wheel
#
# Settings (environment): VENV (default .venv-gpu), PYTHON (default python3), and
# BENCH_ARGS, extra tools/bench.py flags, e.g. BENCH_ARGS="--models resnet50 --runs 10".
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.installed"

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "bench_gpu.sh: no NVIDIA GPU here (nvidia-smi missing or failing); for the CPU run 'make bench'" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader

pip_args=(--quiet)
if [[ -n "${WHEELS:-}" ]]; then
    if [[ ! -d "$WHEELS" ]]; then
        echo "bench_gpu.sh: WHEELS=$WHEELS is not a directory; point it at a folder of wheels (see the top of this script)" >&2
        exit 2
    fi
    pip_args+=(--no-index --find-links "$WHEELS")
fi

# Install once; again only when pyproject.toml changes (as the Makefile does for .venv).
if [[ ! -f "$STAMP" || pyproject.toml -nt "$STAMP" ]]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install "${pip_args[@]}" 'tensorflow[and-cuda]>=2.16,<2.22'
    "$VENV/bin/python" -m pip install "${pip_args[@]}" -e .
    touch "$STAMP"
fi

start=$SECONDS
# Full-size models at GPU batches (small batches leave a GPU launch-bound, where float16
# cannot help), few runs: process starts, tracing and cuDNN autotuning on each variant's
# first call are most of the time. Fits a 16 GB GPU; shrink with BENCH_ARGS if not.
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/python" tools/bench.py --device gpu --target float16 \
    --resnet-batch 128 --resnet-train-batch 64 --bert-batch 32 --bert-train-batch 32 \
    --runs 5 --warmup 2 --pass-runs 3 --child-timeout 120 ${BENCH_ARGS:-}
# Serving converted SavedModels at batch 1 and 8 (ResNet50, the BERT encoder, MobileNetV2):
# float32, convert --target float16 (weights stored float16), convert --float32-weights and
# convert --tune speed --batch-sizes 1,8 (each op timed on this GPU in float32 and float16 with
# its casts, those that do not pay kept float32; what the timing moved and cost, and
# convert's own check against the source); sizes, load time, peak RSS and GPU memory, ratios
# of calls timed in turn (tools/bench_serving.py; its own section of BENCHMARKS.md).
# Not yet run on a GPU: the --tune part has only run on CPUs (its timing Session assumes, as
# TensorFlow's DirectSession does by default, that a call returns once the GPU is done).
# SERVING_ARGS: extra flags, e.g. SERVING_ARGS="--models bert --rounds 30".
# shellcheck disable=SC2086
TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/python" tools/bench_serving.py --device gpu --child-timeout 600 ${SERVING_ARGS:-}
echo "bench_gpu.sh: measured in $((SECONDS - start)) s" >&2
