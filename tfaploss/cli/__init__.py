"""The ``tfaploss`` command: train, evaluate, export, demo.

    tfaploss demo                                     # the end-to-end tour (about 2 minutes)
    tfaploss recipes                                  # the shipped recipes; `show NAME` prints one
    tfaploss train --config recipe:roadmap_sop_resnet50 --set data.train=sop/train
    tfaploss evaluate --model runs/x/model.keras --data sop/test --protocol sop
    tfaploss evaluate --config recipe:demo_digits     # the untrained baseline
    tfaploss export --model runs/x/model.keras --out serving/sop
    tfaploss config --config my_run.yaml              # print it, validated
    tfaploss compare --config base.yaml --val data/x/val --features   # which loss, which batch

Every ``--config`` takes a YAML file or ``recipe:NAME`` (resolved by the config loader).
The Beam preprocessing jobs are separate: ``python -m tfaploss.pipelines.<name> --help``.
Heavy imports (TensorFlow, Keras) happen inside the commands so ``--help`` is instant.

What the commands report goes through the ``tfaploss`` loggers (:mod:`tfaploss.log`);
:func:`main` shows them as plain lines (INFO on stdout, warnings and errors on stderr,
no escape codes, so a log file stays readable): at INFO by default, only warnings and
errors with ``--quiet``, everything with ``--verbose``. Both flags go before or after
the command name (``tfaploss --quiet train ...`` = ``tfaploss train ... --quiet``).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import textwrap

from tfaploss.cli.evaluate import cmd_evaluate, load_any_model, show_config_warnings
from tfaploss.log import is_terminal

_CONFIG_HELP = ("run config: a YAML file, or recipe:NAME for a shipped recipe "
                "(`tfaploss recipes` lists them)")
_SET_HELP = (
    "override one config key, YAML-typed; repeatable. Examples: --set training.epochs=3 "
    "--set optimizer.lr=2e-5 --set evaluation.ks=[1,10] --set model.weights=null "
    "--set loss.temperature=0.05"
)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def _add_output_flags(p, *, top: bool = False) -> None:
    """``--quiet`` / ``--verbose``, on the main parser and on every command (there
    with defaults suppressed, so ``tfaploss --quiet train`` keeps the main one)."""
    default = False if top else argparse.SUPPRESS
    group = p.add_argument_group("output")
    group.add_argument(
        "-q", "--quiet", action="store_true", default=default,
        help="show only warnings, errors and the results (evaluate's table, the paths "
             "written): no progress bars (train: one line per epoch)")
    group.add_argument(
        "-v", "--verbose", action="store_true", default=default,
        help="also show debug messages, each line with its time, logger and level "
             "(and those of the models and pipelines packages)")


def _add_train(sub):
    p = sub.add_parser(
        "train", formatter_class=_Formatter,
        help="train an embedding model from a YAML recipe",
        description=textwrap.dedent("""\
            Train an embedding model from a run config: your YAML file, or a shipped
            recipe as --config recipe:NAME (`tfaploss recipes` lists them).

            The config names the TFRecords (data.train, data.test; write them with a
            pipelines job), the model, the loss, the optimizer and how long to train.
            A batch larger than training.chunk_size is trained with multi-stage
            backpropagation (tfaploss.training.MultiStageModel): same gradient as
            one pass over the whole batch, the memory of one chunk.

            Everything goes to the run directory (run_dir, or --run-dir):
              config.yaml    the validated config        logs/        TensorBoard
              epochs.jsonl   per-epoch loss/lr/metrics   model.keras  the model
              backup/        checkpoint of the last finished epoch
              summary.json   epochs, steps, timings, final metrics
            A killed run resumes from its last finished epoch when you run the same
            command again: every file is written to a temporary name and renamed into
            place, so a kill at any moment loses at most the epoch in progress; the
            same command on a finished run does nothing.
            The run directory is checked first: a damaged one (a file cut short, not
            UTF-8, not YAML or JSON, absurd numbers: what no kill leaves) stops with
            exit status 2 and a message naming the file; nothing is changed, and the
            run never starts over by itself. --restart starts over at epoch 1, moving
            the previous run's files aside into RUN_DIR/damaged-<time>/ (or
            previous-<time>/), never deleting them. One run per run directory: a
            second run started on it exits with status 2, naming the first (its PID,
            since when, its command).
            Optional parts the config names are checked first: a missing one
            (evaluation.backend: scann without ScaNN) stops with exit status 2 and
            the pip install line, before anything is trained. The default
            evaluation.backend, auto, needs none: exact search, or with
            evaluation.target_recall the best searcher installed (ScaNN, else exact).
            Training stops (exit status 3) at the first non-finite loss or weight,
            and nothing non-finite is saved. With stdout not a terminal (a log file),
            progress is one line per epoch."""),
        epilog=textwrap.dedent("""\
            examples:
              tfaploss train --config recipe:demo_digits --run-dir demo_output/run2
                  (after `tfaploss demo`, which wrote demo_output/)
              tfaploss train --config recipe:smoothap_sop_resnet50 \\
                  --set data.train=data/sop/train --set data.test=data/sop/test \\
                  --set model.weights=path/to/resnet50_notop.h5
              tensorboard --logdir runs/"""))
    p.add_argument("--config", required=True, metavar="YAML", help=_CONFIG_HELP)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=_SET_HELP)
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="where checkpoints, logs and the model go (default: the config's "
                        "run_dir)")
    p.add_argument("--restart", action="store_true",
                   help="start over at epoch 1 whatever the run directory holds (a "
                        "damaged, unfinished or finished run): its files are moved aside "
                        "into RUN_DIR/damaged-<time>/ or previous-<time>/, not deleted")
    p.add_argument("--verify-data", choices=("sizes", "full", "off"), default="sizes",
                   help="check the data against its manifest.json before the first step: "
                        "sizes (default, no read), full (also every file's checksum: one "
                        "read of the split) or off")
    p.add_argument("--skip-damaged-shards", action="store_true",
                   help="leave out damaged shards of the training split and go on (found "
                        "by a full check at start-up; counted in summary.json) instead of "
                        "stopping")
    ranks = p.add_argument_group(
        "several processes", "PyTorch: launch with torchrun (torchrun --nproc_per_node N "
        "--no-python tfaploss train ...), which these flags are not for. JAX: one "
        "tfaploss train per process, all with the same --coordinator; rank 0 writes the "
        "run directory (docs/scale_out.md)")
    ranks.add_argument("--coordinator", metavar="HOST:PORT",
                       help="JAX: address of process 0's coordinator, or 'auto' to take "
                            "the processes from the launcher's environment (SLURM, Open "
                            "MPI, Kubernetes); default $JAX_COORDINATOR_ADDRESS")
    ranks.add_argument("--num-processes", type=int, metavar="N",
                       help="JAX: processes in the run (default $JAX_NUM_PROCESSES)")
    ranks.add_argument("--process-id", type=int, metavar="I",
                       help="JAX: this process's rank, 0..N-1 (default $JAX_PROCESS_ID)")
    _add_output_flags(p)
    p.set_defaults(func=cmd_train)


def _add_evaluate(sub):
    p = sub.add_parser(
        "evaluate", formatter_class=_Formatter,
        help="retrieval metrics of a model on a TFRecord split",
        description=textwrap.dedent("""\
            Embed a split with a model and report retrieval metrics (Recall@K,
            Precision@1, MAP@R, R-precision, mAP; mAP/mP@K for revisited
            Oxford/Paris), as a table on screen and metrics.json + figures in --out
            (metrics.json first; without matplotlib, pip install "tfaploss[viz]", the
            figures are skipped with a warning).

            --model: a .keras file (e.g. RUN_DIR/model.keras) or a SavedModel written
            by `tfaploss export` (its version folder or the folder holding versions).
            Load only models you trust: a SavedModel can run arbitrary graph code.
            --config instead of --model: the UNTRAINED model `tfaploss train` would
            start from (same seed, weights and BatchNorm calibration), the baseline to
            compare a trained model with; --data then defaults to the config's
            data.test and --ks to its evaluation.ks.
            --data:  a split folder written by a pipelines job (holds manifest.json).
            Without --query each image of --data queries all the others.

            Preprocessing (printed in the header): the shorter side is resized to
            image_size / 0.875 and the centre image_size square is kept (e.g. 64 px:
            resize to 73, crop 64), which cuts the borders; --image-size original
            embeds each image whole, at its own size."""),
        epilog=textwrap.dedent("""\
            examples:
              tfaploss evaluate --model runs/sop/model.keras --data data/sop/test --protocol sop
              tfaploss evaluate --config recipe:demo_digits   (untrained baseline)
              tfaploss evaluate --model serving/roxf/1 --data data/roxford5k/database \\
                  --query data/roxford5k/queries --gnd data/roxford5k/gnd_roxford5k.json \\
                  --protocol revisited --image-size original"""))
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=".keras file or exported SavedModel")
    source.add_argument("--config", metavar="YAML",
                        help="evaluate the untrained model `tfaploss train --config YAML` "
                             "starts from (a baseline); YAML: a file or recipe:NAME")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --config: " + _SET_HELP)
    p.add_argument("--data", default=None, metavar="SPLIT_DIR",
                   help="database split (TFRecord folder); with --config, default: its "
                        "data.test")
    p.add_argument("--protocol", default="retrieval",
                   help="retrieval (default; ks 1,10,100), sop (1,10,100,1000), "
                        "inaturalist (1,4,16,32), cub, cars, revisited / roxford / rparis, "
                        "gldv2")
    p.add_argument("--query", default=None, metavar="SPLIT_DIR",
                   help="separate query split (revisited, gldv2, or any query/database set)")
    p.add_argument("--gnd", default=None,
                   help="ground truth for revisited (the gnd_<dataset>.json that "
                        "tfaploss.pipelines.revisited writes; a gnd_*.pkl is refused with the command "
                        "that converts it) or gldv2")
    p.add_argument("--ks", default=None, help="comma-separated cut-offs, e.g. 1,10,100 "
                                              "(default: the protocol's)")
    p.add_argument("--backend", default=None,
                   choices=("auto", "exact", "scann", "scann_ah", "faiss"),
                   help="search backend (default: the config's, else auto: exact search "
                        "without --target-recall, with it the best installed searcher "
                        "tuned to it, ScaNN, else faiss, else exact; scann_ah: "
                        "approximate, for large databases; faiss: flat, or tuned with "
                        "--target-recall; scann and scann_ah need pip install "
                        "\"tfaploss[scann]\", faiss pip install \"tfaploss[faiss]\")")
    p.add_argument("--target-recall", type=float, default=None, metavar="R",
                   help="tune the search to reach recall@k >= R in (0, 1] against exact "
                        "search (k: the largest cut-off), measured on a sample of the "
                        "queries; exact search when no setting beats it (default: the "
                        "config's evaluation.target_recall, else none: search with "
                        "--backend as is)")
    p.add_argument("--image-size", default=None,
                   help="side of the centre crop the images are resized to, or 'original' "
                        "(default: the model's input size, else 224)")
    p.add_argument("--batch-size", type=int, default=64, help="images embedded at once")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write metrics.json and figures here (default: eval_<split> "
                        "beside the model; with --config, RUN_DIR/eval_untrained_<split>)")
    _add_output_flags(p)
    p.set_defaults(func=cmd_evaluate)


def _add_export(sub):
    p = sub.add_parser(
        "export", formatter_class=_Formatter,
        help="write a SavedModel for TF Serving",
        description=textwrap.dedent("""\
            Export a trained model as a TF Serving SavedModel in OUT/<version>/.

            Signatures: serving_default takes encoded images (JPEG, PNG, GIF, BMP or
            WebP, input 'image_bytes', so the REST API accepts {"b64": ...}) and returns
            {"embedding": float32 [N, D]}; embed_pixels takes float RGB pixels.
            With --index, retrieve takes the same image_bytes (and an optional k, at
            most --k) and returns the k nearest catalogue items: {"keys", "scores",
            "labels"} (keys: the ids the split or embed job recorded); retrieve_pixels
            takes pixels. The index is searched exactly in the graph with stock
            TensorFlow ops, and travels with the model in the same version folder: a
            new index is a new version. An index embedded by another model is refused.
            Serve it with:
              tensorflow_model_server --rest_api_port=8501 \\
                  --model_name=retrieval --model_base_path=$PWD/OUT"""),
        epilog=textwrap.dedent("""\
            examples:
              tfaploss export --model runs/sop/model.keras --out serving/sop
              tfaploss export --model runs/sop/model.keras --out serving/sop \\
                  --index data/sop/test --k 10
              python -c 'import numpy as np; np.save("q.npy", np.array(
                  [open("q.jpg", "rb").read()], dtype=object))'
              saved_model_cli run --dir serving/sop/1 --tag_set serve \\
                  --signature_def retrieve --inputs image_bytes=q.npy"""))
    p.add_argument("--model", required=True, help="a .keras model (e.g. RUN_DIR/model.keras)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="model base directory; the version folder is created inside")
    p.add_argument("--image-size", type=int, default=None,
                   help="side of the square crop served images are resized to (default: the "
                        "model's input size, else 224)")
    p.add_argument("--max-request-pixels", type=int, default=None,
                   help="largest total width x height of one request's images, checked "
                        "before decoding (default: 4 x the 40-megapixel per-image limit)")
    p.add_argument("--version", type=int, default=None,
                   help="version number (default: one more than the largest in OUT)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing version")
    p.add_argument("--index", default=None, metavar="SPLIT_OR_EMBEDDINGS",
                   help="add the retrieve signature over this catalogue: a split folder "
                        "(embedded now with --model) or the output folder of python -m "
                        "tfaploss.pipelines.embed run with this model's export")
    p.add_argument("--k", type=int, default=None,
                   help="with --index: the most results a request gets (default 10)")
    p.add_argument("--index-backend", choices=("brute_force", "scann"), default=None,
                   help="with --index: brute_force (default; exact, stock TF Serving) or "
                        "scann (approximate; needs ScaNN here and a TF Serving build with "
                        "ScaNN's ops)")
    _add_output_flags(p)
    p.set_defaults(func=cmd_export)


def _add_demo(sub):
    from tfaploss.demo import DEMO_DESCRIPTION, add_demo_arguments

    p = sub.add_parser(
        "demo", formatter_class=_Formatter,
        help="end-to-end demo on scikit-learn's handwritten digits (offline, ~3 min)",
        description=DEMO_DESCRIPTION)
    add_demo_arguments(p)
    _add_output_flags(p)
    p.set_defaults(func=cmd_demo)


def _add_config(sub):
    p = sub.add_parser(
        "config", formatter_class=_Formatter,
        help="validate a run config and print it with every default filled in",
        description="Load a run config, apply --set overrides, validate it, and print "
                    "the result as YAML. Exits 2 with the offending key named when the "
                    "config is invalid.")
    p.add_argument("--config", required=True, metavar="YAML", help=_CONFIG_HELP)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=_SET_HELP)
    _add_output_flags(p)
    p.set_defaults(func=cmd_config)


def _add_recipes(sub):
    p = sub.add_parser(
        "recipes", formatter_class=_Formatter,
        help="list the recipes shipped with tfaploss; `recipes show NAME` prints one",
        description=textwrap.dedent("""\
            The run configs shipped with tfaploss: the papers' recipes (their and the
            authors' values) and the demo's. Listed with their descriptions; `show NAME`
            prints one as shipped, comments included, to start your own config from.
            Any --config takes recipe:NAME to run one as it is (with --set overrides)."""),
        epilog=textwrap.dedent("""\
            examples:
              tfaploss recipes
              tfaploss recipes show smoothap_sop_resnet50 > my_run.yaml
              tfaploss train --config recipe:smoothap_sop_resnet50 \\
                  --set data.train=data/sop/train --set data.test=data/sop/test"""))
    actions = p.add_subparsers(dest="recipes_action", metavar="ACTION")
    show = actions.add_parser("show", formatter_class=_Formatter,
                              help="print one recipe's YAML as shipped",
                              description="Print recipe NAME's YAML as shipped.")
    show.add_argument("name", metavar="NAME", help="a recipe's name (see `tfaploss recipes`)")
    _add_output_flags(show)
    _add_output_flags(p)
    p.set_defaults(func=cmd_recipes)


def _add_compare(sub):
    from tfaploss.cli.compare import DESCRIPTION, add_arguments, cmd_compare

    p = sub.add_parser(
        "compare", formatter_class=_Formatter,
        help="which loss, which batch, for my data: every loss tuned alike, with seeds "
             "and intervals",
        description=DESCRIPTION)
    add_arguments(p)
    _add_output_flags(p)
    p.set_defaults(func=cmd_compare)


def _add_verify(sub):
    p = sub.add_parser(
        "verify", formatter_class=_Formatter,
        help="check a split's TFRecord files against its manifest (sizes, checksums)",
        description=textwrap.dedent("""\
            Check the record files of a split folder (or of every split folder below
            DIR) against its manifest.json in one pass: each file's size and CRC-32C
            and, with --records, every record (framing, features, labels among the
            manifest's classes). A manifest without checksums (older pipelines): each
            record's own CRCs. Exit 0 when all agree; 2 with one line per damaged
            file and the command that rebuilds the split."""))
    p.add_argument("dir", metavar="DIR",
                   help="a split folder written by a pipelines job (OUT/train), or OUT")
    p.add_argument("--records", action="store_true",
                   help="also parse every record and check its features (slower)")
    p.add_argument("--sizes-only", action="store_true",
                   help="only sizes and file names against the manifest (no read)")
    _add_output_flags(p)
    p.set_defaults(func=cmd_verify)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfaploss", formatter_class=_Formatter,
        description=textwrap.dedent("""\
            tfaploss: train image-retrieval embeddings by directly optimising Average
            Precision (histogram AP, FastAP, Smooth-AP, ROADMAP, PNP) in Keras 3.

            New here? Run `tfaploss demo`, then read README.md; `tfaploss recipes`
            lists the papers' recipes. Data preparation is done by the Beam jobs:
            python -m tfaploss.pipelines.<sop|inaturalist|gldv2|revisited|folder|
            tfds_source|glyphs> --help"""))
    from tfaploss import __version__

    parser.add_argument("--version", action="version", version=f"tfaploss {__version__}")
    _add_output_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    _add_train(sub)
    _add_evaluate(sub)
    _add_export(sub)
    _add_config(sub)
    _add_recipes(sub)
    _add_compare(sub)
    _add_verify(sub)
    return parser


# ---------------------------------------------------------------------------------------


def command_output(quiet: bool = False, verbose: bool = False):
    """Context in which the ``tfaploss`` loggers' lines are shown as :mod:`tfaploss.log`
    describes: INFO by default, WARNING with ``quiet``, DEBUG (with time, logger and
    level, and the ``models`` and ``pipelines`` loggers too) with ``verbose``."""
    from tfaploss.log import command_output

    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    return command_output(level, detailed=verbose,
                          others_level=logging.DEBUG if verbose else logging.WARNING)


def _quiet_tensorflow(argv: list[str]) -> None:
    """Keep TensorFlow's C++ start-up lines (``cuInit`` failing on a machine without a
    GPU is logged as an error, oneDNN notices) off the terminal unless asked for.

    Runs first in :func:`main`, before anything imports TensorFlow (``import tfaploss``
    and this module do not): TensorFlow reads ``TF_CPP_MIN_LOG_LEVEL`` once, as it
    loads. 3 hides its INFO, WARNING and ERROR lines (2 still shows the ``cuInit``
    error); a value the user set is kept, and ``-v`` / ``--verbose`` leaves
    TensorFlow's own default (everything shown).
    """
    if not any(a in ("-v", "--verbose") for a in argv):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def cmd_config(args) -> int:
    import yaml

    from tfaploss.config import load_config

    show_config_warnings()
    cfg = load_config(args.config, args.set)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def cmd_recipes(args) -> int:
    from tfaploss.config.recipes import list_recipes, recipe_text, recipes_dir

    try:
        if args.recipes_action == "show":
            sys.stdout.write(recipe_text(args.name))  # verbatim: `> my.yaml` starts a config
            sys.stdout.flush()
            return 0
        recipes = list_recipes()
        width = max((len(r.name) for r in recipes), default=0)
        for recipe in recipes:
            print(f"{recipe.name:<{width}}  {recipe.description}")
        if is_terminal():  # the hint for a person; a pipe gets the table alone
            print(f"\n{len(recipes)} recipes in {recipes_dir()}. Start a config from one: "
                  "tfaploss recipes show NAME > my.yaml; run one as it is: tfaploss train "
                  "--config recipe:NAME")
        sys.stdout.flush()
    except BrokenPipeError:
        # `tfaploss recipes | head`: the reader stopped early; what is left unwritten goes
        # to /dev/null, so that the interpreter's last flush raises no second error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_train(args) -> int:
    from tfaploss.config import load_config

    show_config_warnings()
    cfg = load_config(args.config, args.set)
    from tfaploss.run.needs import check_config_extras
    from tfaploss.run.trainer import train

    check_config_extras(cfg)  # train() checks too; here before its run directory
    from tfaploss.run import processes

    processes.start(cfg.training.distribute, coordinator=args.coordinator,
                    num_processes=args.num_processes, process_id=args.process_id)
    train(cfg, run_dir=args.run_dir, verbose=2 if args.quiet or not is_terminal() else 1,
          restart=args.restart, verify_data=args.verify_data,
          skip_damaged=args.skip_damaged_shards)
    return 0


def cmd_export(args) -> int:
    from tfaploss.export import DamagedIndexError, IndexMismatchError, export_saved_model
    from tfaploss.export.retrieval_search import DEFAULT_K

    if not (os.path.isfile(args.model) and args.model.endswith(".keras")):
        raise SystemExit(f"error: --model {args.model!r} is not a .keras file (train one "
                         "with `tfaploss train`; it writes RUN_DIR/model.keras)")
    if args.index is None and (args.k is not None or args.index_backend is not None):
        raise SystemExit("error: --k and --index-backend go with --index")
    retrieval = {"k": DEFAULT_K if args.k is None else args.k,
                 "index_backend": args.index_backend or "brute_force"}
    model, size = load_any_model(args.model)
    size = args.image_size or size or 224
    try:
        target = export_saved_model(model, args.out, image_size=(size, size),
                                    version=args.version, overwrite=args.overwrite,
                                    max_request_pixels=args.max_request_pixels,
                                    index=args.index, **retrieval)
    except (DamagedIndexError, IndexMismatchError) as err:
        raise SystemExit(f"error: --index: {err}") from None
    print(f"Exported SavedModel to {target}")
    print(f"  serve: tensorflow_model_server --rest_api_port=8501 --model_name=retrieval "
          f"--model_base_path={os.path.abspath(args.out)}")
    print("  query: POST http://localhost:8501/v1/models/retrieval:predict "
          '{"instances": [{"b64": "<base64 JPEG>"}]}')
    if args.index is not None:
        print('  retrieve: POST ... {"signature_name": "retrieve", "inputs": '
              '{"image_bytes": [{"b64": "<base64 JPEG>"}], "k": ' f'{retrieval["k"]}' '}}')
    return 0


def cmd_verify(args) -> int:
    from tfaploss.data.verify import command

    return command(args)


def cmd_demo(args) -> int:
    from tfaploss.demo import run_demo

    return run_demo(out=args.out, quick=args.quick, steps=args.steps)


def main(argv: list[str] | None = None) -> int:
    _quiet_tensorflow(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.quiet = bool(getattr(args, "quiet", False))
    args.verbose = bool(getattr(args, "verbose", False))
    if args.quiet and args.verbose:
        parser.error("--quiet and --verbose exclude each other")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from tfaploss.cli.output import finish, guarded_stdout
    from tfaploss.config import ConfigError
    from tfaploss.extras import MissingExtraError

    try:
        with command_output(args.quiet, args.verbose) as shown, guarded_stdout():
            status = int(args.func(args) or 0)
            finish(shown)  # output on a full disk: an error while it can still be told
            return status
    except (ConfigError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # SIGTERM / Ctrl-C during training: checkpointed; the shell's status of the signal.
        preemption = sys.modules.get("tfaploss.durable.preemption")
        if preemption is not None and isinstance(err, preemption.Preempted):
            print(f"tfaploss: {err}", file=sys.stderr)
            return err.status
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            print(f"error: {err}", file=sys.stderr)  # a full disk: one line, no traceback
            return 2
        guards = sys.modules.get("tfaploss.training.guards")  # loaded if training ran
        if guards is not None and isinstance(err, guards.NonFiniteTrainingError):
            print(f"error: {err}", file=sys.stderr)
            return 3
        processes = sys.modules.get("tfaploss.run.processes")  # rank 0 stopped
        if processes is not None and isinstance(err, processes.RankStoppedError):
            print(f"error: {err}", file=sys.stderr)
            return 1
        # A damaged run directory, or one another run holds: like a config error.
        checkpoints = sys.modules.get("tfaploss.durable.checkpoints")
        locks = sys.modules.get("tfaploss.durable.locks")
        integrity = sys.modules.get("tfaploss.data.integrity")  # a damaged record file
        ledger = sys.modules.get("tfaploss.compare.protocol")  # a damaged compare ledger
        if ((integrity is not None and isinstance(err, integrity.DamagedDataError))
                or (ledger is not None and isinstance(err, ledger.DamagedLedgerError))):
            print(f"error: {err}", file=sys.stderr)
            return 2
        if ((checkpoints is not None and isinstance(err, checkpoints.DamagedRunError))
                or (locks is not None and isinstance(err, locks.LockError))):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise

