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
    """``python -m tfaploss.pipelines.<job>`` without what the job imports: one line with
    the install command and exit status 2, not a traceback. Runs while Python imports
    this package on its way to the job (``sys.argv[0]`` is ``"-m"``; ``argv``,
    ``sys.orig_argv``, names the module); any other import is left alone.
    """
    at = next((i for i, arg in enumerate(argv[1:], 1) if arg.startswith("-m")), None)
    module = None if at is None else (
        argv[at][2:] or (argv[at + 1] if at + 1 < len(argv) else None))
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
        # The job's __main__ never runs: without its console, the ``tfaploss`` logger's
        # NullHandler would keep Python's last-resort handler from writing this.
        from tfaploss.pipelines import console

        console.configure()
        console.PACKAGE.error("error: %s", err)
        sys.exit(2)


if sys.argv[:1] == ["-m"]:
    _check_job_extras(getattr(sys, "orig_argv", []))
