"""Grappler as an oracle, and the built-in Keras model and loop graphs that tests, tools and the demo use."""
