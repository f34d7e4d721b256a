# The README's quick start: a small Keras 3 Sequential model exported as a SavedModel in my_model/.
# Run in a process of its own (docs-test: fresh), so its layers get the names a fresh process
# gives them (sequential_1/dense_1/... in the traced graph).
import keras

model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.export("my_model", verbose=False)
