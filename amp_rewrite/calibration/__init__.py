"""Running models: read a SavedModel or GraphDef file and write its rewrite
(``savedmodel``), validate a rewrite against the original (``validate``), measure every
float tensor (``statistics``) and calibrate (``calibrate``). Library code for Python and
the ``amp-rewrite`` command alike: ``cli`` imports this package, never the reverse.
"""
