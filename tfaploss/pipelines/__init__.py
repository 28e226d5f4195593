"""Apache Beam jobs that turn raw image datasets into sharded TFRecords.

One job per source, all sharing :mod:`tfaploss.pipelines.runner` (plan -> Beam -> publish),
:mod:`tfaploss.pipelines.images` (the per-image work) and :mod:`tfaploss.pipelines.tf_example` (the
record format)::

    python -m tfaploss.pipelines.sop          --input_dir SOP_ROOT    --output_dir OUT [Beam options]
    python -m tfaploss.pipelines.inaturalist  --input_dir INAT_ROOT   --output_dir OUT
    python -m tfaploss.pipelines.gldv2        --input_dir GLDV2_ROOT  --output_dir OUT [--subset train|retrieval]
    python -m tfaploss.pipelines.revisited    --input_dir ROXF_ROOT   --output_dir OUT --dataset roxford5k
    python -m tfaploss.pipelines.folder       --input_dir TREE        --output_dir OUT [--test_classes a,b]
    python -m tfaploss.pipelines.tfds_source  --dataset cars196 --data_dir TFDS_DIR --output_dir OUT
    python -m tfaploss.pipelines.glyphs       --input_dir FONTS_DIR   --output_dir OUT [--charset cjk]

Each module also exposes ``run(argv: list[str] | None = None) -> dict`` that runs the
job in-process and returns ``{split: manifest_dict}``. Beam's own options
(``--runner``, ``--direct_num_workers``, ``--project``, ``--setup_file ./setup.py``, ...)
pass through; without ``--runner`` the job runs on the local DirectRunner in one
process whose image work runs in one forked process per CPU (``--image_processes``; see
:mod:`tfaploss.pipelines.image_workers`).

Output layout (one folder per split)::

    OUT/<split>/images-00000-of-00004.tfrecord     one tf.train.Example per image
    OUT/<split>/by_class/classes-00000-of-00001.tfrecord
                                                   one record per class chunk (train splits)
    OUT/<split>/manifest.json                      counts, label map, options, failures
    OUT/<split>/dead_letters.jsonl                 one JSON object per rejected input
    OUT/<split>/ignored_files.jsonl                files deliberately left out, with why

Record ``i`` of a split's ``n`` (sorted by id) is in shard ``i * num_shards // n``; a
shard with no record is not written. A rerun writes into ``OUT/.incoming/`` and swaps
each split in only when it is complete (:mod:`tfaploss.pipelines.storage`).

The jobs need the ``beam`` extra (``pip install "tfaploss[beam]"``; ``tfds_source`` also
``tfds``, the Dask runner ``dask``): ``python -m tfaploss.pipelines.<job>`` without it stops with
one line saying so. ``import pipelines`` itself needs nothing beyond the core install.

The record schemas, key by key, are :data:`tfaploss.pipelines.tf_example.IMAGE_FEATURES`
(one ``tf.train.Example`` per image) and ``CLASS_FEATURES`` (one record per chunk of a
class, the layout :mod:`tfaploss.data` samples P classes x m images from).
"""

import sys

JOBS = ("sop", "inaturalist", "gldv2", "revisited", "folder", "tfds_source", "glyphs")

# The extra modules each job imports, beyond apache_beam (the beam extra, every job).
_JOB_NEEDS = {"glyphs": (("beam", ("apache_beam", "fontTools")),),
              "tfds_source": (("beam", ("apache_beam",)), ("tfds", None))}


def _check_job_extras(argv: list[str]) -> None:
    """``python -m tfaploss.pipelines.<job>`` without what the job imports: one line naming the
    job and the install command, exit status 2, instead of the traceback of the job's
    first ``import apache_beam``.

    Python imports this package on its way to the job module, while ``sys.argv[0]``
    is ``"-m"``; ``argv`` (``sys.orig_argv``) names the module. Any other import of
    ``tfaploss.pipelines`` (tfaploss's own code, the tests, a Beam worker) is left alone.
    """
    module = None
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            module = argv[i + 1] if i + 1 < len(argv) else None
            break
        if arg.startswith("-m"):
            module = arg[2:]
            break
    if not module or not module.startswith("tfaploss.pipelines."):
        return
    job = module.split(".")[2]
    if job not in (*JOBS, "embed"):
        return
    from tfaploss import extras

    needs = _JOB_NEEDS.get(job, (("beam", ("apache_beam",)),))
    if any("DaskRunner" in arg for arg in argv):
        needs = (*needs, ("dask", None))
    try:
        for extra, modules in needs:
            extras.require(extra, f"python -m tfaploss.pipelines.{job}", modules)
    except extras.MissingExtraError as err:
        # The job's __main__ never runs, so set up its console here: the ``tfaploss``
        # logger's NullHandler would keep Python's last-resort handler from writing it.
        from tfaploss.pipelines import console

        console.configure()
        console.PACKAGE.error("error: %s", err)
        sys.exit(2)


if sys.argv[:1] == ["-m"]:
    _check_job_extras(getattr(sys, "orig_argv", []))
