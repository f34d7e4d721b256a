"""The float8 steps of the rewrite, one module each, over what they share.

* ``inference`` — target float8: the matmuls the float16 rewrite converted take
  float8_e4m3fn operands, with per-tensor scales from calibration or from the weights.
* ``training`` — FP8 training: a training step's forward matmuls on E4M3, their backward
  ones on E5M2 gradients, with delayed scaling.
* ``loops`` — FP8 training inside a step's while loops, and the rewrite of one step with them.

``formats`` holds the facts they read (the formats, the matmul ops, the powers of two each
dtype holds exactly) and ``nodes`` how they read and add an item's nodes. This package
imports none of them, so that importing one step does not import the others.
"""
