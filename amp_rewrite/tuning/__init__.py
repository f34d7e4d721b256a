"""Precision decisions that time the machine they run on (``--tune speed``, issue 37).

The op lists decide by op type, as grappler does; on a CPU without AMX a bfloat16
depthwise convolution, or the casts around a float32 island, can cost more than the
low-precision kernels save. This layer times each candidate op at the shapes it runs with,
in float32 and in the target, and the casts between them (``timing``), keeps the timings in
a file per machine (``cache``), and decides which converted ops to keep float32 so the
whole costs least (``decide``). It builds on ``core`` only, so the live training rewrite
can read the same cache; the model-level steps (shapes from a SavedModel's signatures, the
whole-model check) are in ``calibration/speed.py``.
"""
