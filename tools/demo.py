"""`make demo`: rewrite a small bundled Keras CNN end to end and print what happened.

For each target it prints grappler's summary line for our rewrite, why the vertices that
stayed float32 did, and how far the rewritten graph's output (run on this CPU) is from
the float32 graph's.
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import amp_rewrite  # noqa: E402
from amp_rewrite.models import build_model_graph, run_model_graph  # noqa: E402


def main() -> None:
    model = build_model_graph("cnn", training=False)
    print(f"Model: small Keras CNN (Conv2D + BatchNormalization + Dense), inference, {len(model.graph_def.node)} nodes")
    reference = run_model_graph(model).outputs[model.fetches[0]]
    for target in amp_rewrite.TARGETS:
        result = amp_rewrite.rewrite_graph_def(model.graph_def, target=target, fetches=model.fetches)
        report = result.report
        print(f"\n== {target} ==")
        print(report.summary())
        converted = sorted({d.op for d in report.decisions if d.converted})
        print(f"Converted ops: {', '.join(converted)}")
        print("Stayed float32, by rule:")
        for rule, count in report.kept_float32().items():
            example = next(d for d in report.decisions if not d.converted and d.rule == rule)
            print(f"  {count:4d}  {rule:18s} e.g. {example.node} ({example.op}): {example.reason}")
        output = run_model_graph(model, result.graph_def).outputs[model.fetches[0]]
        error = float(np.max(np.abs(output.astype(np.float32) - reference)))
        print(f"Max |output - float32 output| on CPU: {error:.2e} (outputs are softmax probabilities)")


if __name__ == "__main__":
    main()
