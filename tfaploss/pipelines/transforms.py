"""Former home of the shared job code, kept so that old imports keep working.

It is now split by what it does:

* :mod:`tfaploss.pipelines.runner`: the job runner (plan -> Beam -> publish), ``SplitPlan``,
  ``run_job``, ``main_wrapper``, ``TooManyFailuresError``;
* :mod:`tfaploss.pipelines.images`: the per-image work (read, decode, resize, JPEG) and the
  failure codes;
* :mod:`tfaploss.pipelines.tf_example`: the hand-written ``tf.train.Example`` wire format and
  TFRecord framing;
* :mod:`tfaploss.pipelines.storage`: files, atomic writes and the staged publish.
"""

from tfaploss.pipelines.images import (  # noqa: F401
    BAD_ANNOTATION,
    BAD_BOX,
    BAD_FILE_NAME,
    DUPLICATE_ID,
    EMPTY_FILE,
    IMAGE_EXTENSIONS,
    MISSING_FILE,
    TOO_LARGE,
    TOO_SMALL,
    TRUNCATED,
    UNDECODABLE,
    UNREADABLE_FOLDER,
    UNSAFE_PATH,
    ImageError,
    crop_box,
    decode_image,
    encode_jpeg,
    process_image_bytes,
    read_bytes,
    resize_max_side,
    to_rgb,
)
from tfaploss.pipelines.runner import (  # noqa: F401
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
from tfaploss.pipelines.tf_example import (  # noqa: F401
    CLASS_FEATURES,
    IMAGE_FEATURES,
    class_chunk_examples,
    class_chunks,
    image_example,
    serialize_example,
)
