"""Mixed precision for a training loop: the live graph rewrite and its loss-scale optimizers."""
