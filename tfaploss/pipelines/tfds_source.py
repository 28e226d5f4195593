"""A prepared TensorFlow Datasets image-classification dataset -> TFRecords.

Nothing is downloaded; ``--split_classes N`` pools the splits for the zero-shot protocol
(CUB: 100, Cars196: 98).

    python -m tfaploss.pipelines.tfds_source --dataset cars196 --data_dir ~/tensorflow_datasets \\
        --output_dir out/cars --splits train,test --split_classes 98
"""

from __future__ import annotations

import sys

import apache_beam as beam

from tfaploss import extras
from tfaploss.pipelines import options as opts
from tfaploss.pipelines import runner as R


def parser():
    p = opts.build_parser(__doc__.splitlines()[0], input_dir_required=False)
    p.add_argument("--dataset", required=True, help="TFDS name, e.g. cars196 or cars196:2.1.0")
    p.add_argument("--data_dir", default=None, help="TFDS data_dir where it is prepared")
    p.add_argument("--splits", default="train,test", help="TFDS splits to read")
    p.add_argument("--image_key", default="image")
    p.add_argument("--label_key", default="label", help="class feature (e.g. class_id for SOP)")
    p.add_argument("--super_label_key", default="", help="super-class feature, if any")
    p.add_argument("--id_key", default="", help="feature holding a unique image id/file name; "
                                                 "default: '<split>:<position>'")
    p.add_argument("--split_classes", type=int, default=0,
                   help="pool the splits; classes < N -> train, the rest -> test")
    p.add_argument("--read_shards", type=int, default=8, help="parallel readers per split")
    return p


def _builder(name: str, data_dir):
    tfds = extras.import_extra("tfds", "tfaploss.pipelines.tfds_source")

    return tfds.builder(name, data_dir=data_dir)


class ReadTfdsRange(beam.DoFn):
    """``(tfds split, start, stop)`` -> records with their undecoded image bytes."""

    def __init__(self, args, offset: int, keep):
        self.args = args
        self.offset = offset  # label offset of the output split (split_classes)
        self.keep = keep      # (lo, hi) label range kept, or None

    def process(self, job):
        import tensorflow_datasets as tfds

        split, start, stop = job
        a = self.args
        builder = _builder(a.dataset, a.data_dir)
        ds = builder.as_dataset(split=f"{split}[{start}:{stop}]", shuffle_files=False,
                                decoders={a.image_key: tfds.decode.SkipDecoding()})
        for pos, ex in enumerate(tfds.as_numpy(ds), start=start):
            label = int(ex[a.label_key]) if a.label_key else -1
            if self.keep is not None and not self.keep[0] <= label < self.keep[1]:
                continue
            ident = ex[a.id_key] if a.id_key else f"{split}:{pos:09d}"
            ident = ident.decode("utf-8", "replace") if isinstance(ident, bytes) else str(ident)
            yield {"id": ident, "path": f"tfds://{a.dataset}/{split}/{pos}", "relpath":
                   f"{split}/{pos}", "label": label - self.offset,
                   "super_label": int(ex[a.super_label_key]) if a.super_label_key else -1,
                   "class_text": str(label), "index": pos, "_bytes": ex[a.image_key]}


def plan(args) -> list[R.SplitPlan]:
    builder = _builder(args.dataset, args.data_dir)
    info = builder.info
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    for s in splits:
        if s not in info.splits:
            raise ValueError(f"--splits: {args.dataset} has no split {s!r}; it has "
                             f"{sorted(info.splits)}")
    for key in filter(None, (args.image_key, args.label_key, args.super_label_key)):
        if key not in info.features:
            raise ValueError(f"{args.dataset} has no feature {key!r}; it has "
                             f"{sorted(info.features)}")
    names = list(getattr(info.features[args.label_key], "names", []) or [])
    num_classes = getattr(info.features[args.label_key], "num_classes", None) or len(names)
    jobs = []
    for s in splits:
        n = info.splits[s].num_examples
        k = max(1, min(args.read_shards, n))
        jobs.extend((s, round(i * n / k), round((i + 1) * n / k)) for i in range(k))

    def source(read_jobs, offset, keep):
        def build(p, prefix):
            return (p | f"{prefix}/Ranges" >> beam.Create(read_jobs)
                    | f"{prefix}/Reshuffle" >> beam.Reshuffle()
                    | f"{prefix}/ReadTfds" >> beam.ParDo(ReadTfdsRange(args, offset, keep)))
        return build

    total = sum(info.splits[s].num_examples for s in splits)
    if args.split_classes:
        if not num_classes or not 0 < args.split_classes < num_classes:
            raise ValueError(f"--split_classes must be in 1..{(num_classes or 1) - 1}, "
                             f"got {args.split_classes}")
        n = args.split_classes
        return [R.SplitPlan(split, [], label_map={i - lo: names[i] if names else str(i)
                                                  for i in range(lo, hi)},
                            source=source(jobs, lo, (lo, hi)), num_records_hint=total)
                for split, lo, hi in (("train", 0, n), ("test", n, num_classes))]
    label_map = dict(enumerate(names))
    return [R.SplitPlan(s, [], label_map=label_map,
                        source=source([j for j in jobs if j[0] == s], 0, None),
                        num_records_hint=info.splits[s].num_examples) for s in splits]


def run(argv: list[str] | None = None) -> dict[str, dict]:
    """Run the job in-process; returns ``{split: manifest}``."""
    return R.run_command("tfds_source", parser(), plan, argv)


if __name__ == "__main__":
    sys.exit(R.main_wrapper(run))
