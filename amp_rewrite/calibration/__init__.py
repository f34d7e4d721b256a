"""Running models: read a SavedModel or GraphDef file and write its rewrite
(``savedmodel``), whole or not at all even when interrupted (``staging``, no TensorFlow:
the command installs its signal handler from it first), validate a rewrite against the
original (``validate``), measure every float tensor (``statistics``) and calibrate
(``calibrate``). Library code for Python and the ``amp-rewrite`` command alike: ``cli``
imports this package, never the reverse.
"""
