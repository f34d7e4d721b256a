# A small Keras model exported as a SavedModel in my_model/ (the examples' SRC),
# and a batch of its input, x, in batch.npz.
import numpy as np
import tensorflow as tf

x = tf.keras.Input(shape=(16,), name="x")
hidden = tf.keras.layers.Dense(32, activation="relu", name="hidden")(x)
probs = tf.keras.layers.Dense(10, activation="softmax", name="probs")(hidden)
model = tf.keras.Model(x, probs)
model.export("my_model", verbose=False)
np.savez("batch.npz", x=np.random.default_rng(0).random((8, 16), np.float32))
