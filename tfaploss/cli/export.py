"""``tfaploss export``: a trained model as a TF Serving SavedModel
(:func:`tfaploss.export.export_saved_model`), with how to serve and query it."""

from __future__ import annotations

import os
import textwrap

from tfaploss.cli.arguments import add_command
from tfaploss.cli.evaluate import load_any_model


def register(sub) -> None:
    add_command(
        sub, "export", cmd_export, _arguments,
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


def _arguments(p) -> None:
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
    p.add_argument("--index", metavar="SPLIT_OR_EMBEDDINGS",
                   help="add the retrieve signature over this catalogue: a split folder "
                        "(embedded now with --model) or the output folder of python -m "
                        "tfaploss.pipelines.embed run with this model's export")
    p.add_argument("--k", type=int, default=None,
                   help="with --index: the most results a request gets (default 10)")
    p.add_argument("--index-backend", choices=("brute_force", "scann"), default=None,
                   help="with --index: brute_force (default; exact, stock TF Serving) or "
                        "scann (approximate; needs ScaNN here and a TF Serving build with "
                        "ScaNN's ops)")


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
