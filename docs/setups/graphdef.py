# A frozen GraphDef in graph.pb: a small tf.function (MatMul, Relu, Softmax) whose output is "Identity".
import numpy as np
import tensorflow as tf

weights = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)


@tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
def model(x):
    return tf.nn.softmax(tf.nn.relu(tf.matmul(x, weights)))


tf.io.write_graph(model.get_concrete_function().graph.as_graph_def(), ".", "graph.pb", as_text=False)
