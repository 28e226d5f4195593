"""Every Keras API tfaploss uses that Keras does not promise to keep, in one place to
check on a Keras upgrade: ``PRIVATE_IMPORTS`` (names from ``keras.src``, imported here
for the rest of the package) and ``PRIVATE_ATTRIBUTES`` (underscore attributes of public
Keras classes the code reads or overrides, with where). ``tests/test_keras_compat.py``
checks both against the installed Keras. Tested with Keras 3.14.1 and 3.15.1 (3.12 and
3.13 lack ``keras.ops.scatter_update(..., reduction=...)``); before widening setup.py's
pin, run that test and ``make test`` on the new Keras.
"""

from __future__ import annotations

# Missing public API: Keras exports ``keras.SymbolicScope`` but no way to tell that one
# is active, i.e. that Keras only traces a function for its output shapes
# (``backend.compute_output_spec``; ``fit`` builds the compiled loss that way, in the
# strategy's cross-replica context). The ranking losses then skip gathering the
# replicas' batch (tfaploss/ops/distribute.py). Same source in Keras 3.15.1.
from keras.src.backend.common.symbolic_scope import in_symbolic_scope

# Missing public API: Keras exports no way to undo the 1/num_replicas scaling that
# tf.distribute applies to a loss. Keras's own train step (keras/src/trainers/
# compile_utils.py, keras/src/backend/tensorflow/trainer.py) reports regularisation
# losses through this function; MultiStageModel's step reports its losses the same way
# (tfaploss/training/multistage.py). Same source in Keras 3.12.4 to 3.15.1.
from keras.src.losses.loss import unscale_loss_for_distribution

# (module, name) of each name imported above: the test imports them one by one.
PRIVATE_IMPORTS = (
    ("keras.src.losses.loss", "unscale_loss_for_distribution"),
    ("keras.src.backend.common.symbolic_scope", "in_symbolic_scope"),
)

# (public class, attribute, "instance" when the attribute is set in __init__/compile/
# build rather than defined on the class, where tfaploss uses it). Missing public API
# for all of them: Keras 3.15 has no public hook for a custom train_step to reuse
# compile()'s loss, its loss tracker and the layers' regularisation losses, none to
# walk nested layers, and none to scale one optimizer's update per variable.
PRIVATE_ATTRIBUTES = (
    ("keras.Model", "_compile_loss", "instance", "tfaploss/training/multistage.py"),
    ("keras.Model", "_loss_tracker", "instance", "tfaploss/training/multistage.py"),
    ("keras.Model", "_get_regularization_losses", "class",
     "tfaploss/training/multistage.py"),
    ("keras.Model", "_aggregate_additional_loss", "class",
     "tfaploss/training/multistage.py"),
    ("keras.layers.Layer", "_flatten_layers", "class",
     "tfaploss/models/batch_norm.py, tfaploss/run/build.py, tfaploss/training/checks.py"),
    ("keras.optimizers.Optimizer", "_trainable_variables", "instance",
     "tfaploss/models/lr_multipliers.py"),
    ("keras.optimizers.Optimizer", "_get_variable_index", "class",
     "tfaploss/models/lr_multipliers.py"),
    ("keras.optimizers.Optimizer", "_backend_update_step", "class",
     "tfaploss/models/lr_multipliers.py"),
)

__all__ = ["PRIVATE_ATTRIBUTES", "PRIVATE_IMPORTS", "in_symbolic_scope",
           "unscale_loss_for_distribution"]
