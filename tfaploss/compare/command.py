"""The ``tfaploss compare`` command: arguments, the run with a progress bar, the report."""

from __future__ import annotations

import json
import logging
import textwrap
import time
from pathlib import Path

from tfaploss import extras
from tfaploss.durable import atomic, locks

LOG = logging.getLogger("tfaploss.compare")

# --quick: a few minutes on a CPU, for a first look or a test.
QUICK = {"losses": "APLoss,Triplet,MultiSimilarity", "batch_sizes": "16,32", "images": 512,
         "updates": 8, "trials": 2, "seeds": "0,1"}
DEFAULTS = {"losses": "APLoss,FastAP,SmoothAP,Triplet,MultiSimilarity,SupCon,ProxyAnchor",
            "batch_sizes": "128,512,2048", "images": 49152, "updates": 64, "trials": 12,
            "seeds": "0,1,2"}

DESCRIPTION = textwrap.dedent("""\
    Which loss, which batch, for my data? Tune every loss the same way on the
    validation classes (Optuna TPE over the learning rate and the loss's own knobs,
    the same number of trials each), then train the pick with several seeds and report
    test MAP@R with 95 % intervals and paired differences against the best peer
    (multi-similarity, SupCon, Proxy-Anchor, triplet), per batch size and budget:
    equal images, equal updates, or the compute-matched control (every batch sees the
    images the largest batch sees in --updates updates).

    Two tiers. --features: the config's backbone (model.weights: your pretrained file)
    embeds every image once; each run trains a 2-layer head on the cached features
    (seconds per run). Without it: each run trains the whole network through `tfaploss
    train` (from scratch with model.weights: null). Every run is cached in OUT/ledger.jsonl:
    run the same command again to resume, or to add losses, batches or seeds.

    Example (the glyph set of `make data-glyphs`):
      tfaploss compare --config configs/demo_digits.yaml --features --quick \\
          --set data.train=data/glyphs/train --set data.test=data/glyphs/test \\
          --val data/glyphs/val --out runs/compare_quick""")


def add_arguments(p) -> None:
    p.add_argument("--config", required=True, metavar="YAML",
                   help="the base run config: data.train, data.test, model (its weights), "
                        "augmentation, optimizer name")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (as for train)")
    p.add_argument("--val", required=True, metavar="DIR",
                   help="the validation split (classes in neither train nor test): the "
                        "only split the tuning sees")
    p.add_argument("--out", default="runs/compare", metavar="DIR")
    p.add_argument("--features", action="store_true",
                   help="the cached-feature tier (frozen backbone, a trained head)")
    p.add_argument("--losses", default=None,
                   help=f"comma-separated (default {DEFAULTS['losses']})")
    p.add_argument("--batch-sizes", default=None, help="default 128,512,2048")
    p.add_argument("--budgets", default="images", help="images, updates, matched (comma-"
                                                       "separated; default images)")
    p.add_argument("--images", type=int, default=None,
                   help="images per run for the 'images' budget (default 49152)")
    p.add_argument("--updates", type=int, default=None,
                   help="updates per run for 'updates' (and 'matched'); default 64")
    p.add_argument("--trials", type=int, default=None, help="tuning trials per cell (12)")
    p.add_argument("--seeds", default=None, help="evaluation seeds (default 0,1,2)")
    p.add_argument("--m", type=int, default=None, help="images per class in a batch "
                                                       "(default: the config's data.m)")
    p.add_argument("--test-classes", type=int, default=None,
                   help="--features: score this many test classes (a fixed draw; all "
                        "by default)")
    p.add_argument("--settings-from", default=None, metavar="RESULTS_JSON",
                   help="instead of the TPE search: the settings another comparison picked "
                        "(its results.json, same budget and batch), each at --lr-factors "
                        "times its learning rate (the fine-tuning tier)")
    p.add_argument("--lr-factors", default="0.1,0.3,1",
                   help="with --settings-from: multiples of the carried learning rate")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: 3 losses, batches 16 and 32, 2 trials, 2 seeds")


def _ints(text, name):
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"tfaploss compare: --{name} takes comma-separated integers; "
                         f"received {text!r}") from None
    if not values:
        raise SystemExit(f"tfaploss compare: --{name} is empty")
    return values


def protocol_from(args):
    from tfaploss.compare.protocol import Protocol

    base = QUICK if args.quick else DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else base[name]
    carried = None
    if args.settings_from:
        from tfaploss.compare.protocol import carried_settings

        results = json.loads(Path(args.settings_from).read_text(encoding="utf-8"))
        budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
        carried = {}
        for budget in budgets:
            carried.update(carried_settings(results, budget))
    try:
        factors = tuple(float(v) for v in args.lr_factors.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"tfaploss compare: --lr-factors takes numbers; received "
                         f"{args.lr_factors!r}") from None
    try:
        return Protocol(
            carried=carried, lr_factors=factors,
            losses=tuple(v.strip() for v in pick("losses").split(",") if v.strip()),
            batch_sizes=_ints(pick("batch_sizes"), "batch-sizes"),
            budgets=tuple(v.strip() for v in args.budgets.split(",") if v.strip()),
            images=int(pick("images")), updates=int(pick("updates")),
            trials=int(pick("trials")), seeds=_ints(pick("seeds"), "seeds"))
    except ValueError as err:
        raise SystemExit(f"tfaploss compare: {err}") from None


def _runner(args, cfg, out: Path, m: int):
    if args.features:
        from tfaploss.compare.features import FeatureRunner, extract_features

        data = extract_features(cfg, {"train": cfg.data.train, "val": args.val,
                                      "test": cfg.data.test}, out)
        return "features", FeatureRunner(data, m=m, dim=cfg.model.embedding_dim,
                                         test_classes=args.test_classes)
    from tfaploss.compare.images import ImageRunner

    return "images", ImageRunner(cfg, args.val, out, epochs=2 if args.quick else 4,
                                 curve_images=500 if args.quick else 4000)


def cmd_compare(args) -> str:
    """Run the comparison ``args`` describes; returns the report's markdown."""
    from tfaploss.config import load_config

    cfg = load_config(args.config, args.set)
    # Before any run: the tuning needs Optuna; without matplotlib only the figure is lost.
    if not args.settings_from:
        extras.require("compare", "tfaploss compare's tuning (Optuna TPE; --settings-from "
                                  "needs no tuning)")
    if not extras.installed("viz"):
        LOG.warning("warning: %s; the report is written without it",
                    extras.MissingExtraError("viz", "the report's figure"))
    for key, path in (("data.train", cfg.data.train), ("data.test", cfg.data.test),
                      ("--val", args.val)):
        if path is None or ("://" not in str(path) and not Path(path).exists()):
            from tfaploss.config import ConfigError

            raise ConfigError(f"{key}: {path!r} does not exist; tfaploss compare needs the "
                              "train, validation and test splits a pipelines job wrote.")
    protocol = protocol_from(args)
    m = args.m or cfg.data.m
    bad = [b for b in protocol.batch_sizes if b % m]
    if bad:
        raise SystemExit(f"tfaploss compare: batch sizes {bad} are not multiples of m={m}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # One comparison per folder: a second would append to the same ledger and write the
    # same feature caches and report. Refused (LockHeldError) naming the holder.
    with locks.exclusive(out, "compare output folder"):
        return _compare(args, cfg, protocol, m, out)


def _compare(args, cfg, protocol, m: int, out: Path) -> str:
    """:func:`cmd_compare` once the output folder is locked."""
    import keras

    from tfaploss.compare import report
    from tfaploss.compare.protocol import Ledger, run

    tier, runner = _runner(args, cfg, out, m)
    if hasattr(runner, "check"):
        try:
            runner.check(protocol.batch_sizes)
        except ValueError as err:
            raise SystemExit(f"tfaploss compare: {err}") from None
    ledger = Ledger(out / "ledger.jsonl", tier)
    total = protocol.total_runs()
    trials = (protocol.trials if protocol.carried is None else len(protocol.lr_factors))
    LOG.info("tfaploss compare (%s tier): %d losses x %d batch sizes x %s; %d trials + %d "
             "seeds per cell: %d runs (%d already in %s)", tier, len(protocol.losses),
             len(protocol.batch_sizes), ",".join(protocol.budgets), trials,
             len(protocol.seeds), total, len(ledger.rows), ledger.path)
    bar = keras.utils.Progbar(total, verbose=0 if args.quiet else 1, unit_name="run")
    done = [0]
    started = time.time()

    def progress(what):
        if what is not None:
            LOG.debug("run: %s", what)
        else:
            done[0] += 1
            bar.update(done[0])

    def counted(spec):
        row = runner(spec)
        done[0] += 1
        bar.update(done[0])
        return row

    results = run(protocol, ledger, counted, progress)
    search = (f"{protocol.trials} TPE trials per (loss, batch, budget) over lr in "
              f"[1e-4, 3e-2] (log) and each loss's knobs" if protocol.carried is None else
              f"the settings of `{args.settings_from}` at lr x "
              f"{', '.join(f'{f:g}' for f in protocol.lr_factors)}")
    header = (f"## tfaploss compare: {tier} tier\n\nConfig `{args.config}`, validation "
              f"`{args.val}`; losses {', '.join(protocol.losses)}; {search}, tuning seed "
              f"{protocol.tuning_seed}; evaluation seeds "
              f"{', '.join(map(str, protocol.seeds))}; m={m}. Cost: "
              f"{len(ledger.rows)} runs, {sum(r.get('seconds', 0) for r in ledger.rows.values()) / 3600:.2f} "
              "hours of run time (wall clock of each run on this machine, summed).")
    text = report.markdown(results, header)
    # Whole or absent; a full disk is one DiskFullError naming the file (fault "report").
    atomic.atomic_write_text(out / "report.md", text, fault="report")
    atomic.atomic_write_text(out / "results.json",
                             json.dumps(results, indent=1, default=str), fault="report")
    figure = report.plot(results, out / "report.png")
    LOG.info("wrote %s, %s%s in %.0f s", out / "report.md", out / "results.json",
             f", {figure}" if figure else f" (no figure: {extras.install_command('viz')})",
             time.time() - started)
    return text
