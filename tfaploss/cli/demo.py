"""``tfaploss demo``: the end-to-end tour on scikit-learn's digits, step by step, told
to the person who runs it (the steps' work: :mod:`tfaploss.demo`)."""

from __future__ import annotations

import shutil
import sys
import textwrap
import time
from pathlib import Path

from tfaploss import demo as D
from tfaploss import extras
from tfaploss.cli.arguments import add_command
from tfaploss.durable.atomic import atomic_write_json

DESCRIPTION = textwrap.dedent("""\
    The whole library on real data that ships with scikit-learn (1,797
    scanned 8x8 digits), offline, in about 2 minutes on a laptop CPU:

      1. write the digits as PNG files, one folder per class
      2. run the Beam `folder` job: PNGs -> TFRecords (train: 0-5, test: 6-9)
      3. evaluate a random small CNN on the unseen digits 6-9 (exact search)
      4. train it with APLoss and multi-stage backpropagation on digits 0-5
      5. evaluate again: Recall@1, MAP@R, mAP; figures and JSON
      6. export a SavedModel with a retrieve signature over the test
         digits; reload it with plain TensorFlow, embed a PNG and
         retrieve its nearest digits
      7. print a summary table

    Everything lands in one folder (--out, default ./demo_output).""")
TOTAL_STEPS = 7
_MARKER = ".tfaploss-demo"


def register(sub) -> None:
    add_command(sub, "demo", cmd_demo, _arguments, description=DESCRIPTION,
                help="end-to-end demo on scikit-learn's handwritten digits (offline, ~3 min)")


def _arguments(parser) -> None:
    parser.add_argument("--out", default="demo_output", metavar="DIR",
                        help="output folder (default: ./demo_output); replaced if it exists")
    parser.add_argument("--quick", action="store_true",
                        help="reduced run for CI (fewer training steps)")
    parser.add_argument("--steps", type=int, default=None,
                        help="total training steps (overrides the default and --quick)")


def cmd_demo(args) -> int:
    return run_demo(out=args.out, quick=args.quick, steps=args.steps)


def _say(step: int, text: str) -> None:
    print(f"\n[{step}/{TOTAL_STEPS}] {text}", flush=True)


def _timed(timings: dict, key: str, work, *args):
    """``work(*args)``, its seconds kept in ``timings[key]``."""
    started = time.time()
    result = work(*args)
    timings[key] = time.time() - started
    return result


def _metrics_line(metrics: dict) -> str:
    return "  " + ", ".join(f"{k} {metrics[k]:.3f}" for k in ("recall@1", "map@r", "map")
                            if k in metrics)


def _prepare_output_dir(out: Path) -> None:
    """Empty ``out`` for a new run, but only if an earlier demo made it (or it is empty).

    The folder is replaced on every run, so a mistyped ``--out`` pointing at the user's
    own files must not be wiped: anything without the demo's marker file is refused.
    """
    if out.exists():
        if not out.is_dir():
            raise SystemExit(f"tfaploss demo: --out {out} exists and is not a folder")
        if any(out.iterdir()) and not (out / _MARKER).exists():
            raise SystemExit(
                f"tfaploss demo: --out {out} is not empty and was not written by the demo; "
                "refusing to replace it. Pick a new or empty folder.")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / _MARKER).write_text("written by `tfaploss demo`; the demo replaces this folder\n")


def run_demo(out: str = "demo_output", quick: bool = False, steps: int | None = None) -> int:
    """Run the demo into ``out``, telling each step; returns 0 on success (any failure
    raises)."""
    # Before the first step: the digits come from scikit-learn, the records from Beam.
    extras.require("demo", "tfaploss demo (scikit-learn's digits)")
    extras.require("beam", "tfaploss demo (its Beam folder job)", ("apache_beam",))
    started = time.time()
    out = Path(out)
    _prepare_output_dir(out)
    timings = {}
    print("tfaploss demo: retrieval of handwritten digits never seen in training")
    print(f"outputs go to {out.resolve()}")

    _say(1, "Writing scikit-learn's 1,797 digit scans as PNG files, one folder per digit")
    png_root = out / "digits_png"
    n = _timed(timings, "write_pngs", D.write_digit_pngs, png_root)
    print(f"  {n} PNGs in {png_root}/<digit>/")

    _say(2, "Beam `folder` job: PNG tree -> TFRecords (train: digits 0-5, test: 6-9)")
    records = out / "tfrecords"
    manifests = _timed(timings, "beam_job", D.run_folder_job, png_root, records)
    for split, manifest in sorted(manifests.items()):
        print(f"  {split}: {manifest['num_images']} images, {manifest['num_classes']} "
              f"classes, {manifest['num_failures']} failures -> {records / split}")
    label_names = manifests["test"]["label_map"]
    cfg = D.build_demo_config(records, out / "run", quick=quick, steps=steps)

    _say(3, "Untrained small CNN on the unseen digits 6-9 (exact search)")
    before = _timed(timings, "evaluate_before", D.measure_untrained, cfg)
    print(_metrics_line(before))

    batch, chunk = cfg.data.batch_size, cfg.training.chunk_size
    _say(4, f"Training with {cfg.loss.name} on digits 0-5: batches of {batch} "
            f"({batch // cfg.data.m} digits x {cfg.data.m}), multi-stage backprop in "
            f"{-(-batch // chunk)} chunks of {chunk}")
    summary = _timed(timings, "train", D.train_demo, cfg)
    history = summary["history"]
    print(f"  loss {history[0]['loss']:.4f} (epoch 1) -> {history[-1]['loss']:.4f} "
          f"(epoch {len(history)}), {summary['updates']} updates")

    _say(5, "Trained model on the unseen digits 6-9; metrics JSON and a figure")
    model, after, figures = _timed(timings, "evaluate_after", D.measure_trained, cfg,
                                   summary["model"], out / "evaluation", label_names)
    print(_metrics_line(after))
    for path in figures:
        print(f"  figure: {path}")

    _say(6, "Export for TF Serving with a retrieve signature over the test split; reload "
            "with plain TensorFlow, query one PNG")
    served = _timed(timings, "export", D.export_and_query, model, cfg, out, png_root,
                    label_names)
    _print_served(served, out)

    elapsed = time.time() - started
    atomic_write_json(out / "demo_summary.json", {
        "before": before, "after": after, "loss_first_epoch": history[0]["loss"],
        "loss_last_epoch": history[-1]["loss"], "updates": summary["updates"],
        "batch_size": batch, "chunk_size": chunk,
        "train_classes": list(D.TRAIN_DIGITS), "test_classes": list(D.TEST_DIGITS),
        "saved_model": served["export_dir"], "served_cosine_vs_keras": served["agreement"],
        "retrieve_query": served["query"], "retrieved": served["retrieved"],
        "timings_seconds": {k: round(v, 2) for k, v in timings.items()},
        "total_seconds": round(elapsed, 1),
    })
    _print_summary(out, before, after, elapsed)
    return 0


def _print_served(served: dict, out: Path) -> None:
    """What step 6 found; stops the demo when the served embedding is not the Keras
    model's."""
    png, agreement = served["png"].relative_to(out), served["agreement"]
    print(f"  SavedModel: {served['export_dir']}")
    print(f"  serving_default({png}) -> {served['dim']}-d embedding, norm "
          f"{served['norm']:.4f}, cosine with the Keras model {agreement:.6f}")
    print(f"  retrieve({png}) -> its {D.RETRIEVE_K} nearest test digits (key, digit, score):")
    for hit in served["retrieved"]:
        print(f"    {hit['key']:<12} {hit['digit']}  {hit['score']:.4f}")
    print(f"  the same from TensorFlow's own tool:\n    saved_model_cli run --dir "
          f"{served['export_dir']} --tag_set serve --signature_def retrieve --inputs "
          f"image_bytes={served['query_npy']}")
    if agreement < 0.999:
        raise RuntimeError(f"the served embedding disagrees with the Keras model "
                           f"(cosine {agreement:.6f})")


def _print_summary(out: Path, before: dict, after: dict, elapsed: float) -> None:
    _say(7, "Summary: retrieval on digits 6-9, never seen in training")
    print(f"  {'metric':<10} {'untrained':>10} {'trained':>10}")
    for key in ("recall@1", "map@r", "map"):
        print(f"  {key:<10} {before[key]:>10.3f} {after[key]:>10.3f}")
    print(f"\nDone in {elapsed:.0f} s. Everything is in {out.resolve()}:")
    for name, what in [
        ("digits_png/", "the PNG tree the Beam job read"),
        ("tfrecords/", "TFRecords + manifest.json per split"),
        ("run/", "model.keras, summary.json, epochs.jsonl, TensorBoard logs/"),
        ("evaluation/", "metrics.json and the retrieval-examples figure"),
        ("saved_model/", "the TF Serving SavedModel, retrieve over the test digits"),
        ("query.npy", "one test digit, for saved_model_cli run --inputs"),
        ("demo_summary.json", "the numbers above"),
    ]:
        print(f"  {name:<18} {what}")
    if after["recall@1"] <= before["recall@1"]:
        print("warning: Recall@1 did not improve; try more steps (--steps)", file=sys.stderr)
