"""Apache Beam jobs that turn raw image datasets into sharded TFRecords.

One job per source, all sharing :mod:`pipelines.runner` (plan -> Beam -> publish),
:mod:`pipelines.images` (the per-image work) and :mod:`pipelines.tf_example` (the
record format)::

    python -m pipelines.sop          --input_dir SOP_ROOT    --output_dir OUT [Beam options]
    python -m pipelines.inaturalist  --input_dir INAT_ROOT   --output_dir OUT
    python -m pipelines.gldv2        --input_dir GLDV2_ROOT  --output_dir OUT [--subset train|retrieval]
    python -m pipelines.revisited    --input_dir ROXF_ROOT   --output_dir OUT --dataset roxford5k
    python -m pipelines.folder       --input_dir TREE        --output_dir OUT [--test_classes a,b]
    python -m pipelines.tfds_source  --dataset cars196 --data_dir TFDS_DIR --output_dir OUT
    python -m pipelines.glyphs       --input_dir FONTS_DIR   --output_dir OUT [--charset cjk]

Each module also exposes ``run(argv: list[str] | None = None) -> dict`` that runs the
job in-process and returns ``{split: manifest_dict}``. Beam's own options
(``--runner``, ``--direct_num_workers``, ``--project``, ``--setup_file ./setup.py``, ...)
pass through; without ``--runner`` the job runs on the local DirectRunner in one
process whose image work runs in one forked process per CPU (``--image_processes``; see
:mod:`pipelines.image_workers`).

Output layout (one folder per split)::

    OUT/<split>/images-00000-of-00004.tfrecord     one tf.train.Example per image
    OUT/<split>/by_class/classes-00000-of-00001.tfrecord
                                                   one record per class chunk (train splits)
    OUT/<split>/manifest.json                      counts, label map, options, failures
    OUT/<split>/dead_letters.jsonl                 one JSON object per rejected input
    OUT/<split>/ignored_files.jsonl                files deliberately left out, with why

Record ``i`` of a split's ``n`` (sorted by id) is in shard ``i * num_shards // n``; a
shard with no record is not written. A rerun writes into ``OUT/.incoming/`` and swaps
each split in only when it is complete (:mod:`pipelines.storage`).

Per-image ``tf.train.Example`` schema (:data:`pipelines.tf_example.IMAGE_FEATURES`):

=========================== ========= ===================================================
key                         type      meaning
=========================== ========= ===================================================
``image/encoded``           bytes     JPEG, RGB, EXIF orientation applied, resized so the
                                      longer side is at most ``--max_side`` (if given)
``image/format``            bytes     ``b"jpeg"``
``image/id``                bytes     the dataset's image id (unique within a split)
``image/path``              bytes     path of the source file relative to ``--input_dir``
``image/index``             int64     position of the image in the split's sorted listing
                                      (for revisited Oxford/Paris: the index into
                                      ``imlist`` / ``qimlist`` the ground truth uses)
``image/height``            int64     height of the encoded image
``image/width``             int64     width of the encoded image
``image/class/label``       int64     class, contiguous ``0..C-1`` per split (-1: none)
``image/class/super_label`` int64     super-class, contiguous ``0..S-1`` (-1: none)
``image/class/text``        bytes     the class as the dataset names it (folder, id)
``image/bbox``              float x4  ``[x0, y0, x1, y1]`` in source pixels; only for
                                      images cropped to a box (revisited queries)
=========================== ========= ===================================================

Per-class ("by_class") record schema (:data:`pipelines.tf_example.CLASS_FEATURES`), the
layout :mod:`tfaploss.data` samples P classes x m images from while streaming:

============================ ========= ==================================================
``class/label``              int64     class label (as in the per-image records)
``class/super_label``        int64     super-class label (-1: none)
``class/num_images``         int64     images of the whole class
``class/chunk``              int64     chunk index within the class
``class/num_chunks``         int64     chunks the class was split into
``image/encoded``            bytes xN  the chunk's JPEGs (N <= ``--class_chunk_size``)
``image/id``                 bytes xN  their ids
============================ ========= ==================================================
"""

JOBS = ("sop", "inaturalist", "gldv2", "revisited", "folder", "tfds_source", "glyphs")
