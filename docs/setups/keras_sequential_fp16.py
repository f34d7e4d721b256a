# keras_sequential.py's model, converted to float16 as the README's quick start does:
# my_model/ and my_model_fp16/.
import keras

from amp_rewrite.cli import main

model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.export("my_model", verbose=False)
assert main(["convert", "my_model/", "my_model_fp16/", "--quiet"]) == 0
