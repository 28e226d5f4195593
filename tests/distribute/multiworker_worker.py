"""One worker of tests/distribute/test_multiworker_tf.py: 3 SGD steps under
``tf.distribute.MultiWorkerMirroredStrategy`` (cluster from ``TF_CONFIG``, one CPU
replica per worker) with ``APLoss``, for a plain Keras model and for
``MultiStageModel``; each run's per-step losses and final weights go to
``<out_dir>/worker<index>.npz``.

Run as ``python -m tests.distribute.multiworker_worker OUT_DIR`` from the repository root. The
test imports the data and model helpers below for its one-device ``fit``, so both
sides train the same model on the same batch.

The steps run in a custom loop (``strategy.run`` in a ``tf.function``), because Keras
3's own loop does not run under this strategy: ``fit`` fails before its first step
(``strategy.reduce`` of the peeked batch, keras-team/keras#20585) and its train
function's mean of the scalar logs over axis 0 fails too. :func:`try_fit` records
what ``fit`` does, so that the test notices when Keras starts to run it.

Data feeding: no auto-sharding. ``experimental_distribute_values_from_function`` hands
each replica the rows of its global replica id, ``16 r .. 16 r + 15``: one item of
every class, so no replica's shard holds a positive pair.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from tests.support.shard_layout import CLASSES, dense_model, layout

WORKERS = 2
BATCH = WORKERS * CLASSES  # the global batch: one item of every class per replica
STEPS = 3
LEARNING_RATE = 0.5
SCENARIOS = ("plain", "multistage")


def data(seed=0):
    """The global batch; replica ``r``'s shard is rows ``16 r .. 16 r + 15``."""
    return layout(WORKERS, seed)


model = dense_model


def compiled(scenario):
    """``(embedding model, model to train)``, compiled with SGD and ``APLoss``."""
    import keras

    from tfaploss.losses import APLoss
    from tfaploss.training import MultiStageModel

    net = model()
    trainer = MultiStageModel(net, chunk_size=8) if scenario == "multistage" else net
    trainer.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=APLoss())
    return net, trainer


def _shards(strategy):
    """``(x, y)`` distributed by global replica id (see the module docstring)."""
    x, y = data()

    def shard(context):
        r = context.replica_id_in_sync_group
        rows = slice(r * CLASSES, (r + 1) * CLASSES)
        return x[rows], y[rows]

    return strategy.experimental_distribute_values_from_function(shard)


def train(scenario, strategy):
    """Per-step losses (the global batch's) and final weights of ``STEPS`` steps."""
    import numpy as np
    import tensorflow as tf

    with strategy.scope():
        net, trainer = compiled(scenario)
        trainer.optimizer.build(trainer.trainable_variables)
    x, y = _shards(strategy)

    def plain_step(x, y):
        with tf.GradientTape() as tape:
            # This replica's share of the global batch's loss (the shares sum to it),
            # as Keras's train_step computes it.
            share = trainer.compute_loss(x, y, trainer(x, training=True))
        grads = tape.gradient(share, trainer.trainable_variables)
        trainer.optimizer.apply(grads, trainer.trainable_variables)
        return share

    def multistage_step(x, y):
        trainer.reset_metrics()  # the step's own loss, not a running mean
        return trainer.train_step((x, y))["loss"]

    @tf.function
    def step(x, y):
        if scenario == "plain":
            shares = strategy.run(plain_step, args=(x, y))
            return strategy.reduce("SUM", shares, axis=None)
        # MultiStageModel logs the global batch's loss on every replica.
        return strategy.experimental_local_results(strategy.run(multistage_step,
                                                                args=(x, y)))[0]

    losses = [float(step(x, y)) for _ in range(STEPS)]
    return np.array(losses), net.get_weights()


def try_fit(strategy):
    """``Model.fit`` under the strategy (each worker's input pipeline holding its
    replica's shard): its per-step losses and final weights, or the error it raises."""
    import numpy as np
    import tensorflow as tf

    x, y = data()
    with strategy.scope():
        net, _ = compiled("plain")

    def pipeline(context):
        worker = context.input_pipeline_id  # one replica per worker
        rows = slice(worker * CLASSES, (worker + 1) * CLASSES)
        return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(CLASSES)

    dataset = strategy.distribute_datasets_from_function(pipeline)
    try:
        history = net.fit(dataset, epochs=STEPS, verbose=0)
    except ValueError as error:
        return str(error)
    return np.array(history.history["loss"]), net.get_weights()


def main(out_dir):
    """Train every scenario, then try ``fit``; write ``worker<index>.npz``."""
    # The strategy first: it sets up the collectives before TensorFlow initialises.
    import tensorflow as tf

    # One thread per op: the two workers and the test process share a few cores, and
    # the ops are tiny.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import numpy as np

    assert strategy.num_replicas_in_sync == WORKERS, strategy.num_replicas_in_sync
    results = {}
    for scenario in SCENARIOS:
        losses, weights = train(scenario, strategy)
        results[f"{scenario}_losses"] = losses
        results.update({f"{scenario}_w{i}": w for i, w in enumerate(weights)})
    fitted = try_fit(strategy)
    if isinstance(fitted, str):
        results["fit_error"] = np.array(fitted)
    else:
        results["fit_losses"] = fitted[0]
        results.update({f"fit_w{i}": w for i, w in enumerate(fitted[1])})
    path = os.path.join(out_dir, f"worker{strategy.cluster_resolver.task_id}.npz")
    np.savez(path + ".tmp.npz", **results)
    os.replace(path + ".tmp.npz", path)  # a reader never sees half a file


if __name__ == "__main__":
    main(sys.argv[1])
