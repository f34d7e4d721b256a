"""The pass itself: graph I/O, op support, lists, colouring, casts, function items, the orchestrator, the report."""
