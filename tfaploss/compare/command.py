"""What ``tfaploss compare`` does once its arguments are read (:mod:`tfaploss.cli.compare`):
check the splits, embed them once, run the protocol from the ledger, write the report
(with the frozen features' and PCA rows, :func:`tfaploss.compare.features.baselines`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import warnings
from pathlib import Path

from tfaploss import extras
from tfaploss.compare.ledger import digest
from tfaploss.durable import atomic, locks

LOG = logging.getLogger("tfaploss.compare")


@dataclasses.dataclass
class Options:
    """What a comparison runs on, beside its :class:`~tfaploss.compare.protocol.Protocol`.

    ``config`` and ``overrides``: the base run config and its ``--set`` lines; ``val``:
    the validation split; ``out``: the output folder (ledger, report, feature caches);
    ``features``: the cached-feature tier (else the image tier); ``m``: images per class
    in a batch (None: the config's ``data.m``); ``head``: the feature tier's head;
    ``test_classes``: test classes the feature tier scores (None: all); ``quick``: the
    image tier's short curves, and the report says its intervals are not informative;
    ``settings_from``: the results file the carried settings came from (for the report).
    """

    config: str
    val: str
    out: str = "runs/compare"
    overrides: tuple = ()
    features: bool = False
    m: int | None = None
    head: str = "residual"
    test_classes: int | None = None
    quick: bool = False
    settings_from: str | None = None


def config_digest(cfg) -> str:
    """What the config says about the runs (its run folder and description aside)."""
    raw = cfg.to_dict()
    raw.pop("run_dir", None)
    raw.pop("description", None)
    return digest(raw)


def _runner(options: Options, cfg, out: Path, m: int, protocol):
    """``(tier, runner)``; the runner trains and scores one run."""
    if options.features:
        from tfaploss.compare.features import FeatureRunner

        return "features", FeatureRunner(_features(cfg, options, out), m=m,
                                         head=options.head, dim=cfg.model.embedding_dim,
                                         test_classes=options.test_classes,
                                         val_folds=protocol.folds)
    from tfaploss.compare.images import ImageRunner

    return "images", ImageRunner(cfg, options.val, out, m=m,
                                 epochs=2 if options.quick else 4,
                                 curve_images=500 if options.quick else 4000)


def _features(cfg, options: Options, out: Path) -> dict:
    from tfaploss.compare.features import extract_features

    return extract_features(cfg, {"train": cfg.data.train, "val": options.val,
                                  "test": cfg.data.test}, out)


def _baselines(options: Options, cfg, runner, out: Path) -> tuple[dict | None, str | None]:
    """The baseline rows and the features' digest: the feature tier's own features; the
    image tier's frozen backbone (the config's weights, no head), embedded once here."""
    from tfaploss.compare.features import FeatureRunner, features_digest

    if not hasattr(runner, "setup"):  # a runner without data (tests)
        return None, None
    if isinstance(runner, FeatureRunner):
        data = {"train": runner.train, "val": runner.val, "test": runner.test}
        return runner.baselines(cfg.model.embedding_dim), features_digest(data)
    data = _features(cfg, options, out)
    scored = FeatureRunner(data, m=1)
    return scored.baselines(cfg.model.embedding_dim), features_digest(data)


def compare(options: Options, protocol, progress=lambda event: None) -> tuple[str, list]:
    """Run the comparison; returns the report's markdown and the results.

    Refuses (``SystemExit`` with one line) what it cannot run, before any run:
    splits that do not exist, batches that are not multiples of m or that the
    training classes cannot fill. One comparison per output folder (its lock).
    """
    from tfaploss.config import ConfigError, ConfigWarning, config_notes, load_config

    cfg = load_config(options.config, list(options.overrides), warn=False)
    # Before any run: the tuning needs Optuna; without matplotlib only the figure is lost.
    if protocol.search() == "tpe":
        extras.require("compare", "tfaploss compare's tuning (Optuna TPE; --settings-from "
                                  "needs no tuning)")
    if not extras.installed("viz"):
        LOG.warning("warning: %s; the report is written without it",
                    extras.MissingExtraError("viz", "the report's figure"))
    for key, path in (("data.train", cfg.data.train), ("data.test", cfg.data.test),
                      ("--val", options.val)):
        if path is None or ("://" not in str(path) and not Path(path).exists()):
            raise ConfigError(f"{key}: {path!r} does not exist; tfaploss compare needs the "
                              "train, validation and test splits a pipelines job wrote.")
    m = options.m or cfg.data.m
    bad = [b for b in protocol.batch_sizes if b % m]
    if bad:
        raise SystemExit(f"tfaploss compare: batch sizes {bad} are not multiples of m={m}")
    # compare sets the batch and m itself, so the config's notes are read as it runs: at
    # its largest batch (a chunk_size that splits none of its batches is still noted;
    # one that only the config's own data.batch_size reaches is not). The feature tier
    # trains a head of its own: the config's chunk_size does not apply to it.
    as_run = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, batch_size=max(protocol.batch_sizes), m=m),
        training=(dataclasses.replace(cfg.training, chunk_size=None) if options.features
                  else cfg.training))
    for note in config_notes(as_run):
        warnings.warn(note, ConfigWarning, stacklevel=2)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    # One comparison per folder: a second would append to the same ledger and write the
    # same feature caches and report. Refused (LockHeldError) naming the holder.
    with locks.exclusive(out, "compare output folder"):
        return _compare(options, cfg, protocol, m, out, progress)


def _compare(options: Options, cfg, protocol, m: int, out: Path, progress):
    """:func:`compare` once the output folder is locked."""
    from tfaploss.compare import report
    from tfaploss.compare.protocol import Ledger, check_runner, run, with_baseline_differences

    tier, runner = _runner(options, cfg, out, m, protocol)
    try:  # before any run
        check_runner(protocol, runner)
        if hasattr(runner, "check"):
            runner.check(protocol.batch_sizes)
    except ValueError as err:
        raise SystemExit(f"tfaploss compare: {err}") from None
    found, fingerprint = _baselines(options, cfg, runner, out)
    setup = {"config": config_digest(cfg), "features": fingerprint, "m": m,
             **(runner.setup() if hasattr(runner, "setup") else {})}
    ledger = Ledger(out / "ledger.jsonl", tier, setup)
    known = len(ledger.runs())
    LOG.info("tfaploss compare (%s tier): %d losses x %d batch sizes x %s; %s; %d "
             "tuning repeat(s) x (trials + %d seeds): %d runs (%d already in %s)", tier,
             len(protocol.losses), len(protocol.batch_sizes), ",".join(protocol.budgets),
             report.search_words(protocol, options.settings_from),
             protocol.tuning_repeats, len(protocol.seeds), protocol.total_runs(), known,
             ledger.path)
    started = time.time()
    results = run(protocol, ledger, runner, progress)
    if found is not None:
        with_baseline_differences(results, found["frozen"]["test_map@r"])
    runs = ledger.runs()
    hours = sum(r.get("seconds", 0) for r in runs) / 3600
    text = report.markdown(results, report.header(
        tier=tier, config=options.config, val=options.val, protocol=protocol, m=m,
        setup=ledger.setup, runs=len(runs), hours=hours, quick=options.quick,
        settings_from=options.settings_from), found)
    # Whole or absent; a full disk is one DiskFullError naming the file (fault "report").
    atomic.atomic_write_text(out / "report.md", text, fault="report")
    document = {"setup": ledger.setup, "baselines": found, "results": results}
    atomic.atomic_write_text(out / "results.json",
                             json.dumps(document, indent=1, default=str), fault="report")
    figure = report.plot(results, out / "report.png", found, quick=options.quick)
    LOG.info("wrote %s, %s%s in %.0f s", out / "report.md", out / "results.json",
             f", {figure}" if figure else f" (no figure: {extras.install_command('viz')})",
             time.time() - started)
    return text, results
