"""Former home of the shared job code, kept so that old imports keep working.

It is now split by what it does:

* :mod:`pipelines.runner`: the job runner (plan -> Beam -> publish), ``SplitPlan``,
  ``run_job``, ``main_wrapper``, ``TooManyFailuresError``;
* :mod:`pipelines.images`: the per-image work (read, decode, resize, JPEG) and the
  failure codes;
* :mod:`pipelines.tf_example`: the hand-written ``tf.train.Example`` wire format and
  TFRecord framing;
* :mod:`pipelines.storage`: files, atomic writes and the staged publish.
"""

from pipelines.images import *
from pipelines.images import ImageError, process_image_bytes, read_bytes  # noqa: F401
from pipelines.runner import (  # noqa: F401
    SplitPlan,
    TooManyFailuresError,
    contiguous_labels,
    dead_letter,
    dedupe_and_index,
    describe_manifests,
    join,
    main_wrapper,
    run_job,
)
from pipelines.tf_example import (  # noqa: F401
    CLASS_FEATURES,
    IMAGE_FEATURES,
    class_chunk_examples,
    class_chunks,
    image_example,
    serialize_example,
)
