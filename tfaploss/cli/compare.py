"""``tfaploss compare``: its arguments, its console (one progress bar, one line per
finished run) and its printed report; the comparison itself is
:func:`tfaploss.compare.command.compare`."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import time
from pathlib import Path

from tfaploss.cli.arguments import add_command, add_config_arguments
from tfaploss.log import is_terminal

# --quick: a few minutes on a CPU, for a first look or a test.
QUICK = {"losses": "APLoss,Triplet,MultiSimilarity", "batch_sizes": "16,32", "images": 512,
         "updates": 8, "seconds": 2.0, "trials": 2, "seeds": "0,1"}
DEFAULTS = {"losses": "APLoss,FastAP,SmoothAP,Triplet,MultiSimilarity,SupCon,ProxyAnchor",
            "batch_sizes": "128,512,2048", "images": 49152, "updates": 64, "seconds": 60.0,
            "trials": 24, "seeds": "0,1,2"}

DESCRIPTION = textwrap.dedent("""\
    Which loss, which batch, for my data? Tune every loss the same way on the
    validation classes (Optuna TPE, or a grid, over the learning rate and the loss's
    own knobs, by one budget rule), then train the pick with several seeds and report
    test MAP@R with 95 % intervals, each loss's difference from the frozen features,
    and paired differences against the best peer (multi-similarity, SupCon,
    Proxy-Anchor, triplet; chosen on validation), per batch size and budget: equal
    images, equal updates, the compute-matched control (every batch sees the
    images the largest batch sees in --updates updates), or equal wall-clock time
    (--features: every loss trains --seconds at each batch).

    Two tiers. --features: the config's backbone (model.weights: your pretrained file)
    embeds every image once; each run trains a head on the cached features (seconds
    per run), by default a full-width residual head that starts at the identity, so
    that step 0 scores exactly the frozen features. Without it: each run trains the
    whole network through `tfaploss train` (from scratch with model.weights: null).
    Every report has a row for the frozen features and one for their PCA to the
    config's embedding size. Every run is cached in OUT/ledger.jsonl, keyed on its
    whole setup (config, features, head, m, test classes): run the same command again
    to resume, or to add losses, batches, seeds or repeats; a changed setup starts new
    cells.

    Example (the glyph set of `make data-glyphs`):
      tfaploss compare --config configs/demo_digits.yaml --features --quick \\
          --set data.train=data/glyphs/train --set data.test=data/glyphs/test \\
          --val data/glyphs/val --out runs/compare_quick""")


def register(sub) -> None:
    add_command(sub, "compare", cmd_compare, add_arguments, description=DESCRIPTION,
                help="which loss, which batch, for my data: every loss tuned alike, with "
                     "seeds and intervals")


def add_arguments(p) -> None:
    from tfaploss.compare.protocol import TRIALS_RULE

    add_config_arguments(p, config_help="the base run config: data.train, data.test, model "
                                        "(its weights), augmentation, optimizer name",
                         set_help="override one config key (as for train)")
    p.add_argument("--val", required=True, metavar="DIR",
                   help="the validation split (classes in neither train nor test): the "
                        "only split the tuning sees")
    p.add_argument("--out", default="runs/compare", metavar="DIR")
    p.add_argument("--features", action="store_true",
                   help="the cached-feature tier (frozen backbone, a trained head)")
    p.add_argument("--head", default="residual", choices=("residual", "linear", "mlp"),
                   help="--features: the head. residual (default): x + W2 relu(W1 x), full "
                        "width, W2 = 0 at step 0; linear: W x, full width, W = I at step "
                        "0; mlp: the earlier random 2-layer head to model.embedding_dim")
    p.add_argument("--losses", default=None,
                   help=f"comma-separated (default {DEFAULTS['losses']})")
    p.add_argument("--batch-sizes", default=None, help="default 128,512,2048")
    p.add_argument("--budgets", default="images",
                   help="images, updates, matched, seconds (comma-separated; default "
                        "images); seconds: the wall-clock-matched budget, --features only")
    p.add_argument("--images", type=int, default=None,
                   help="images per run for the 'images' budget (default 49152)")
    p.add_argument("--updates", type=int, default=None,
                   help="updates per run for 'updates' (and 'matched'); default 64")
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds of updates per run for 'seconds' (each loss's updates "
                        "come from its timed seconds per update at the batch); default 60")
    p.add_argument("--trials", type=int, default=None,
                   help=f"the base of the tuning budget (default {DEFAULTS['trials']}): "
                        f"{TRIALS_RULE}")
    p.add_argument("--grid", type=int, default=None, metavar="N",
                   help="instead of TPE: every point of a grid of N learning rates, "
                        "log-spaced over the whole range, times --grid-knob-points "
                        "points of each knob")
    p.add_argument("--grid-knob-points", type=int, default=3, metavar="K",
                   help="with --grid: points per knob, end to end (1: the range's middle); "
                        "default 3")
    p.add_argument("--tuning-repeats", type=int, default=1, metavar="R",
                   help="tune R times (tuning seeds 1000..1000+R-1), evaluate each pick "
                        "on the seeds; the intervals are then over the R repeats' means "
                        "(tuning and seed noise) instead of the seeds (seed noise only)")
    p.add_argument("--repeat-by", choices=("seeds", "folds"), default="seeds",
                   help="what makes the tuning repeats independent: their tuning seeds "
                        "(default), or class-disjoint folds of the validation classes "
                        "(repeat r picks on fold r; --features only): with --grid every "
                        "repeat shares one set of trials, R times fewer runs")
    p.add_argument("--seeds", default=None, help="evaluation seeds (default 0,1,2)")
    p.add_argument("--m", type=int, default=None, help="images per class in a batch "
                                                       "(default: the config's data.m)")
    p.add_argument("--test-classes", type=int, default=None,
                   help="--features: score this many test classes (a fixed draw; all "
                        "by default)")
    p.add_argument("--settings-from", default=None, metavar="RESULTS_JSON",
                   help="instead of the search: the settings another comparison picked "
                        "(its results.json, same budget and batch), each at --lr-factors "
                        "times its learning rate (the fine-tuning tier)")
    p.add_argument("--lr-factors", default="0.1,0.3,1",
                   help="with --settings-from: multiples of the carried learning rate")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: 3 losses, batches 16 and 32, a base of 2 trials, "
                        "2 seeds; its intervals are not informative")


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
    """The :class:`~tfaploss.compare.protocol.Protocol` the arguments describe."""
    from tfaploss.compare.protocol import Protocol, carried_settings

    base = QUICK if args.quick else DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else base[name]
    budgets = tuple(b.strip() for b in args.budgets.split(",") if b.strip())
    carried = None
    if args.settings_from:
        results = json.loads(Path(args.settings_from).read_text(encoding="utf-8"))
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
            batch_sizes=_ints(pick("batch_sizes"), "batch-sizes"), budgets=budgets,
            images=int(pick("images")), updates=int(pick("updates")),
            seconds=float(pick("seconds")),
            trials=int(pick("trials")), seeds=_ints(pick("seeds"), "seeds"),
            tuning_repeats=args.tuning_repeats, repeat_by=args.repeat_by, grid=args.grid,
            grid_knob_points=args.grid_knob_points)
    except ValueError as err:
        raise SystemExit(f"tfaploss compare: {err}") from None


def options_from(args):
    from tfaploss.compare.command import Options

    return Options(config=args.config, val=args.val, out=args.out,
                   overrides=tuple(args.set), features=args.features, m=args.m,
                   head=args.head, test_classes=args.test_classes, quick=args.quick,
                   settings_from=args.settings_from)


class Console:
    """One line per finished run and, on a terminal, one progress bar under them.

    ``total`` runs; a run found in the ledger moves the bar without a line.
    """

    def __init__(self, total: int, quiet: bool = False, stream=None):
        self.total, self.quiet = total, quiet
        self.stream = stream or sys.stdout
        self.done = self.cached = 0
        self.started = time.time()
        # progress bars only on a terminal (tfaploss.log.is_terminal's rule), never in a log
        self.bar = (is_terminal() if stream is None else stream.isatty()) and not quiet

    def _bar(self) -> str:
        width = 30
        filled = int(width * self.done / max(1, self.total))
        elapsed = time.time() - self.started
        return (f"[{'=' * filled}{'.' * (width - filled)}] {self.done}/{self.total} runs, "
                f"{elapsed:.0f} s")

    def __call__(self, event: dict) -> None:
        self.done += 1
        if event["cached"]:
            self.cached += 1
        elif not self.quiet:
            clear = "\r\033[K" if self.bar else ""
            self.stream.write(clear + line(event, self.done, self.total) + "\n")
        if self.bar:
            self.stream.write("\r\033[K" + self._bar())
        self.stream.flush()

    def close(self) -> None:
        if self.bar:
            self.stream.write("\r\033[K")
        if self.cached and not self.quiet:
            self.stream.write(f"{self.cached} of {self.total} runs taken from the ledger\n")
        self.stream.flush()


def line(event: dict, done: int, total: int) -> str:
    """A finished run, in one line."""
    spec, row = event["spec"], event["row"]
    width = len(str(total))
    from tfaploss.compare.protocol import settings_text

    what = (f"seed {spec.seed}" if spec.test else "trial") + (
        f" (repeat {event['repeat']})" if event.get("repeat") else "")
    settings = settings_text(spec.settings)
    score = lambda key: (f"{row[key]:.1f}" if isinstance(row.get(key), (int, float))
                         else "–")
    scores = f"val {score('val_map@r')}" + (f", test {score('test_map@r')}" if spec.test
                                            else "")
    status = row.get("status", "ok")
    return (f"[{done:>{width}}/{total}] {spec.loss} B={spec.batch} u={spec.updates} {what}: "
            f"{scores}" + ("" if status == "ok" else f" ({status})")
            + f" in {row.get('seconds', 0):.1f} s  [{settings}]")


class _OnlyCompare(logging.Filter):
    """The console's filter while a comparison runs: what the runs' own code logs
    (``tfaploss train``'s header and notes, feature extraction's internals) goes to
    each run's log, not to the console; errors still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("tfaploss.compare") or record.levelno >= logging.ERROR


def _console_handlers():
    from tfaploss.log import PlainHandler

    return [h for h in logging.getLogger("tfaploss").handlers if isinstance(h, PlainHandler)]


def cmd_compare(args) -> int:
    from tfaploss.cli.config import show_config_notes
    from tfaploss.compare.command import compare

    show_config_notes()
    protocol = protocol_from(args)
    console = Console(protocol.total_runs(), quiet=args.quiet)
    handlers = [] if args.verbose else _console_handlers()
    only = _OnlyCompare()
    for handler in handlers:
        handler.addFilter(only)
    try:
        text, _ = compare(options_from(args), protocol, console)
    finally:
        console.close()
        for handler in handlers:
            handler.removeFilter(only)
    print(text)  # the report's tables: the command's result
    return 0
