"""Apache Beam jobs that turn raw image datasets into sharded TFRecords.

One job per source (``python -m tfaploss.pipelines.<job> --input_dir ... --output_dir
OUT [Beam options]``), each also ``run(argv) -> {split: manifest}`` in-process; they
need the ``beam`` extra, ``import tfaploss.pipelines`` itself nothing beyond the core
install. The jobs, the output layout and the record schemas
(:data:`tfaploss.pipelines.tf_example.IMAGE_FEATURES`, ``CLASS_FEATURES``):
docs/pipelines.md and docs/data.md.
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
