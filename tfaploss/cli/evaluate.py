"""``tfaploss evaluate``: retrieval metrics of a ``.keras`` model, an exported SavedModel,
or a config's untrained model, on a split of TFRecords.
"""

from __future__ import annotations

import os
import sys
import textwrap

from tfaploss.cli.arguments import SET_HELP, add_command, add_config_arguments
from tfaploss.cli.config import load_run_config
from tfaploss.log import is_terminal


def load_any_model(path: str):
    """A callable images -> embeddings from a ``.keras`` file or an exported SavedModel.

    Returns ``(callable, input_size)`` where ``input_size`` is the model's fixed square
    input side, or None.
    """
    if os.path.isfile(path) and path.endswith(".keras"):
        import keras

        from tfaploss.training import MultiStageModel

        # Registration needs no import here: `import tfaploss` did it (tfaploss._registration).
        model = keras.saving.load_model(path, compile=False)
        if isinstance(model, MultiStageModel):
            model = model.embedding_model
        shape = tuple(model.input_shape)
        return model, (shape[1] if shape[1] is not None and shape[1] == shape[2] else None)
    if os.path.isdir(path):
        from tfaploss.export import find_saved_model, load_pixels_embedder

        try:
            version_dir = find_saved_model(path)
        except FileNotFoundError:
            raise SystemExit(f"error: --model {path!r} is neither a .keras file nor a "
                             "SavedModel folder (no saved_model.pb, no version folders)"
                             ) from None
        return load_pixels_embedder(version_dir)
    raise SystemExit(f"error: --model {path!r} does not exist or is not a .keras file / "
                     "SavedModel folder")


def describe_preprocessing(size: int | None) -> str:
    """How ``make_eval_dataset`` turns a stored image into model input, in words."""
    if size is None:
        return ("each image whole, at its own size (no resize, no crop; one image per "
                "batch)")
    from tfaploss.data.augment import DEFAULT_CROP_FRACTION

    resize = round(size / DEFAULT_CROP_FRACTION)  # tfaploss.data.center_crop's default
    return (f"shorter side resized to {resize} px, then the centre {size}x{size} px kept: "
            f"{resize - size} px of the shorter side and more of the longer one are cut "
            "off at the borders (--image-size original embeds whole images)")


def _eval_dataset(path: str, size: int | None, batch: int):
    """``make_eval_dataset`` with its length set from manifest.json, so progress bars
    show a total."""
    import tensorflow as tf

    from tfaploss.data import make_eval_dataset, read_manifest
    from tfaploss.data.split_manifest import is_job_output

    dataset = make_eval_dataset(path, image_size=size, batch_size=batch)
    # Only a split folder's own manifest counts its images (not one for a glob of files).
    own = os.path.isdir(path) and is_job_output(path)
    n = (read_manifest(path) or {}).get("num_images") if own else None
    if isinstance(n, int) and n > 0:
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(-(-n // batch)))
    return dataset, n


def _parse_image_size(value, default):
    if value in (None, ""):
        return default
    if value == "original":
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"error: --image-size must be an integer or 'original'; "
                         f"received {value!r}") from None


def register(sub) -> None:
    add_command(
        sub, "evaluate", cmd_evaluate, _arguments,
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


def _arguments(p) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=".keras file or exported SavedModel")
    add_config_arguments(p, group=source, set_help="with --config: " + SET_HELP,
                         config_help="evaluate the untrained model `tfaploss train --config "
                                     "YAML` starts from (a baseline); YAML: a file or "
                                     "recipe:NAME")
    p.add_argument("--data", metavar="SPLIT_DIR", help="database split (TFRecord folder); "
                   "with --config, default: its data.test")
    p.add_argument("--protocol", default="retrieval", help="retrieval (default; ks 1,10,100), "
                   "sop (1,10,100,1000), inaturalist (1,4,16,32), cub, cars, revisited / "
                   "roxford / rparis, gldv2")
    p.add_argument("--query", metavar="SPLIT_DIR",
                   help="separate query split (revisited, gldv2, or any query/database set)")
    p.add_argument("--gnd", help="ground truth for revisited (the gnd_<dataset>.json that "
                   "tfaploss.pipelines.revisited writes; a gnd_*.pkl is refused with the "
                   "command that converts it) or gldv2")
    p.add_argument("--ks", help="comma-separated cut-offs, e.g. 1,10,100 (default: the "
                   "protocol's)")
    p.add_argument("--backend", choices=("auto", "exact", "scann", "scann_ah", "faiss"),
                   help="search backend (default: the config's, else auto: exact search "
                        "without --target-recall, with it the best installed searcher "
                        "tuned to it, ScaNN, else faiss, else exact; scann_ah: "
                        "approximate, for large databases; faiss: flat, or tuned with "
                        "--target-recall; scann and scann_ah need pip install "
                        "\"tfaploss[scann]\", faiss pip install \"tfaploss[faiss]\")")
    p.add_argument("--target-recall", type=float, metavar="R",
                   help="tune the search to reach recall@k >= R in (0, 1] against exact "
                        "search (k: the largest cut-off), measured on a sample of the "
                        "queries; exact search when no setting beats it (default: the "
                        "config's evaluation.target_recall, else none: search with "
                        "--backend as is)")
    p.add_argument("--image-size", help="side of the centre crop the images are resized to, "
                   "or 'original' (default: the model's input size, else 224)")
    p.add_argument("--batch-size", type=int, default=64, help="images embedded at once")
    p.add_argument("--out", metavar="DIR", help="write metrics.json and figures here "
                   "(default: eval_<split> beside the model; with --config, "
                   "RUN_DIR/eval_untrained_<split>)")


def cmd_evaluate(args) -> int:
    from tfaploss.data import read_manifest

    if args.set and not args.config:
        raise SystemExit("error: --set changes a run config; it needs --config")
    cfg = None
    if args.config:
        cfg = load_run_config(args)
        if args.data is None:
            if not cfg.data.test:
                raise SystemExit(f"error: {args.config} has no data.test; give --data")
            args.data = cfg.data.test
    elif args.data is None:
        raise SystemExit("error: --data is required with --model (the split to evaluate)")
    plan = _search_plan(args, cfg)

    for name in ("data", "query"):
        value = getattr(args, name)
        if value is not None and not os.path.exists(value):
            raise SystemExit(f"error: --{name} {value!r} does not exist (a split folder "
                             "written by a pipelines job)")
    if cfg is not None:
        from tfaploss.run.trainer import initial_model

        model = initial_model(cfg)
        size = _parse_image_size(args.image_size, cfg.test_image_size)
        what = f"the untrained model of {args.config} (what `tfaploss train` starts from)"
        default_out = os.path.join(cfg.run_dir, "eval_untrained_")
    else:
        model, model_size = load_any_model(args.model)
        size = _parse_image_size(args.image_size, model_size or 224)
        what = args.model
        default_out = os.path.join(os.path.dirname(os.path.abspath(args.model)), "eval_")
    batch = args.batch_size if size else 1
    ks = cfg.evaluation.ks if cfg is not None else None
    if args.ks:
        try:
            ks = [int(k) for k in args.ks.split(",") if k.strip()]
        except ValueError:
            raise SystemExit(f"error: --ks must be comma-separated integers, e.g. 1,10,100; "
                             f"received {args.ks!r}") from None
    figures = _check_evaluate_extras(plan, "--backend" if args.backend or cfg is None
                                     else "evaluation.backend")

    database, n_db = _eval_dataset(args.data, size, batch)
    query, n_q = _eval_dataset(args.query, size, batch) if args.query else (None, None)
    out = args.out or default_out + os.path.basename(os.path.normpath(args.data))
    print(f"tfaploss evaluate: {what}")
    print(f"  data           {args.data}" + (f" ({n_db} images)" if n_db else "")
          + (f", queries {args.query}" + (f" ({n_q} images)" if n_q else "")
             if args.query else ", each image queries all the others"))
    print(f"  protocol       {args.protocol}, "
          + plan.describe()
          + (f", ks {','.join(map(str, ks))}" if ks else ""))
    print(f"  preprocessing  {describe_preprocessing(size)}", flush=True)

    import tensorflow as tf

    from tfaploss.data.integrity import check_or_raise, reading
    from tfaploss.evaluation import evaluate

    progress = not args.quiet and is_terminal()
    label_names = (read_manifest(args.data) or {}).get("label_map")
    for split in (args.data, args.query):
        if split:
            check_or_raise(split, "sizes", layouts=("images",), what="evaluating")
    try:
        with reading(args.data, args.query, what="evaluating"):
            result = evaluate(model, database, protocol=args.protocol, query=query,
                              gnd=args.gnd, ks=ks, backend=plan, output_dir=out,
                              figures=figures,
                              label_names=label_names, verbose=1 if progress else 0)
    except tf.errors.FailedPreconditionError as err:
        raise SystemExit(f"error: a split holds another number of images than its "
                         f"manifest.json says ({err.message.splitlines()[0]}); write it "
                         "again with its pipelines job") from None
    if not progress:
        print(result.table())
    print(f"\nWrote {os.path.join(out, 'metrics.json')}"
          + (f" and {len(result.figures)} figure(s)" if result.figures else ""))
    return 0


def _search_plan(args, cfg):
    """The config's search plan (else the default one), with ``--backend`` and
    ``--target-recall`` over it."""
    import dataclasses

    from tfaploss.evaluation.search_plan import SearchPlan

    plan = cfg.evaluation.search_plan if cfg is not None else SearchPlan()
    flags = {k: v for k, v in (("backend", args.backend),
                               ("target_recall", args.target_recall)) if v is not None}
    try:
        return dataclasses.replace(plan, **flags) if flags else plan
    except ValueError as err:  # --backend's choices are argparse's: the target's range
        raise SystemExit(f"error: --target-recall: {err}") from None


def _check_evaluate_extras(plan, key: str) -> bool:
    """Before any embedding: the search's extra must be installed (else
    MissingExtraError); returns whether figures can be drawn (without matplotlib they
    are skipped, with a warning: metrics.json is written all the same)."""
    from tfaploss import extras

    need = plan.required_extra(key)
    if need is not None:
        extras.require(*need)
    if not extras.installed("viz"):
        print(f"warning: {extras.MissingExtraError('viz', 'drawing the figures')}; "
              "skipping them (metrics.json is written as usual)", file=sys.stderr)
        return False
    return True

