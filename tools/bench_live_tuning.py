"""Does ``--tune speed``'s cache help a bfloat16 training step? (issue 37, training part)

The live rewrite (``amp_rewrite.mixed_precision``, ``enable_mixed_precision_graph_rewrite``)
converts a training step as the lists say; given ``timing_cache=``, each trace also keeps
float32 what the cache says runs slower in the target, timing nothing on the step's path.
This script times the step's ops once, before training, into a cache
(``amp_rewrite.tune_step``), then traces three copies of one training step, a custom loop
as TensorFlow's "training loop from scratch" guide writes it (GradientTape, Keras
optimizers), and times them in turn on the same batches:

* float32 (no rewrite);
* ``mixed_precision(target="bfloat16")``: the lists alone;
* ``mixed_precision(target="bfloat16", timing_cache=FILE)``: the lists and the cache.

Speed-up = median over rounds of float32's step time / the variant's. Models (``--model``):
``mobilenetv2``, MobileNetV2 (``keras.applications``, weights=None, 10 classes) at 96x96,
batch 16; ``gan``, a GAN on scikit-learn's digits (an MLP generator and discriminator, two
Adam optimizers) under a MirroredStrategy of two CPU replicas, global batch 128.

    TF_CPP_MIN_LOG_LEVEL=2 nice -n 10 .venv/bin/python tools/bench_live_tuning.py   # a few minutes
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_live_tuning.py --model gan
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_live_tuning.py --smoke     # tiny CNN: checks the script

"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def mobilenet(smoke: bool) -> tuple[Any, tuple[Any, ...]]:
    """A maker of MobileNetV2's training step (one model and optimizer for all), and one batch."""
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    size, batch = (32, 4) if smoke else (96, 16)
    if smoke:
        model = keras.Sequential([keras.Input((size, size, 3)), keras.layers.Conv2D(8, 3, activation="relu6"),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    else:
        model = keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3), classes=10,
                                               classifier_activation=None)
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, size, size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(batch,)).astype("int32"))

    def make_step() -> Any:
        @tf.function
        def step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                logits = tf.cast(model(x, training=True), tf.float32)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss
        return step
    return make_step, (x, y)


def gan() -> tuple[Any, tuple[Any, ...]]:
    """A maker of a GAN's training step on digits: two models, two Adam optimizers, two CPU
    replicas of a MirroredStrategy, each replica updating both; and one global batch."""
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    keras.utils.set_random_seed(0)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    batch, noise = 128, 16
    with strategy.scope():
        generator = keras.Sequential([keras.Input((noise,)), keras.layers.Dense(256, activation="relu"),
                                      keras.layers.Dense(64, activation="sigmoid")])
        critic = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                   keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])
        g_optimizer, c_optimizer = keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3)
        g_optimizer.build(generator.trainable_variables)
        c_optimizer.build(critic.trainable_variables)
    cross_entropy = keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum")
    digits = (load_digits().data / 16).astype("float32")
    real = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(digits).batch(batch))))

    def replica(real: Any) -> tuple[Any, Any]:
        z = tf.random.normal((tf.shape(real)[0], noise))
        with tf.GradientTape() as g_tape, tf.GradientTape() as c_tape:
            fake = generator(z, training=True)
            on_real, on_fake = critic(real, training=True), critic(fake, training=True)
            c_loss = (cross_entropy(tf.ones_like(on_real), on_real)
                      + cross_entropy(tf.zeros_like(on_fake), on_fake)) / batch
            g_loss = cross_entropy(tf.ones_like(on_fake), on_fake) / batch
        c_optimizer.apply_gradients(zip(c_tape.gradient(c_loss, critic.trainable_variables), critic.trainable_variables))
        g_optimizer.apply_gradients(zip(g_tape.gradient(g_loss, generator.trainable_variables),
                                        generator.trainable_variables))
        return c_loss, g_loss

    def make_step() -> Any:
        @tf.function
        def step(real: Any) -> Any:
            return [strategy.reduce("SUM", loss, None) for loss in strategy.run(replica, (real,))]
        return step
    return make_step, (real,)


def time_steps(steps: dict[str, Any], batch: tuple[Any, ...], rounds: int) -> dict[str, list[float]]:
    """Each step called in turn, the order rotated per round, after two warm-up calls each."""
    import tensorflow as tf

    def call(step: Any) -> None:
        [tensor.numpy() for tensor in tf.nest.flatten(step(*batch))]
    for step in steps.values():
        for _ in range(2):
            call(step)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for index in range(rounds):
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            start = time.perf_counter()
            call(steps[name])
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny CNN, 2 rounds: checks the script")
    parser.add_argument("--model", choices=("mobilenetv2", "gan"), default="mobilenetv2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=30.0, help="seconds for timing the step's ops")
    args = parser.parse_args(argv)
    import amp_rewrite

    make_step, batch = gan() if args.model == "gan" and not args.smoke else mobilenet(args.smoke)
    steps = {"float32": make_step()}
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-live-tuning-") as directory:
        cache = Path(directory) / "timings.json"
        tuned = amp_rewrite.tune_step(steps["float32"], *batch, timing_cache=cache,
                                      budget_s=2.0 if args.smoke else args.budget)
        for name, options in (("bfloat16 (lists)", {}), ("bfloat16 (lists + timing_cache)", {"timing_cache": cache})):
            with amp_rewrite.mixed_precision(target="bfloat16", **options):
                steps[name] = make_step()
                steps[name].get_concrete_function(*batch)
    seconds = time_steps(steps, batch, 2 if args.smoke else args.rounds)
    print(tuned.summary())
    for name, times in seconds.items():
        ratio = statistics.median(a / b for a, b in zip(seconds["float32"], times))
        print(f"| {name} | {statistics.median(times) * 1e3:,.1f} ms | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
