"""Embed a large image set with an exported SavedModel, through Beam's RunInference.

    python -m tfaploss.pipelines.embed --input OUT/test --model EXPORT/1 --output EMB [Beam options]

Inputs, outputs (``tfaploss.evaluation.load_embeddings(EMB)`` reads them) and the
staged publish: docs/pipelines.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from tfaploss.durable import atomic, faults, locks
from tfaploss.pipelines import console, storage
from tfaploss.pipelines import options as opts

beam = console.import_beam_quietly()

from apache_beam.ml.inference.base import (
    KeyedModelHandler,
    ModelHandler,
    PredictionResult,
    RunInference,
)
from apache_beam.options.pipeline_options import PipelineOptions

from tfaploss.pipelines.console import main_wrapper
from tfaploss.pipelines.manifests import DEAD_LETTERS, MANIFEST, TooManyFailuresError

LOG = logging.getLogger("tfaploss.pipelines.embed")  # not __name__: "__main__" under -m
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")
_COUNTER_NS = "tfaploss.embed"


class _LoadedModel:
    """The loaded SavedModel (a signature holds only weak references to its variables)
    and its signature; a class, as Beam's model sharing takes a weak reference to it."""

    def __init__(self, loaded, fn):
        self.loaded = loaded
        self.fn = fn


class SavedModelBytesHandler(ModelHandler):
    """A Beam ``ModelHandler``: encoded image bytes -> embedding. A batch refused for an
    undecodable image is rerun image by image, the bad ones with ``{"error": message}``."""

    def __init__(self, model_path: str, signature: str = "serving_default",
                 input_key: str | None = None, output_key: str | None = None,
                 min_batch_size: int = 1, max_batch_size: int = 32):
        super().__init__(min_batch_size=min_batch_size, max_batch_size=max_batch_size)
        self.model_path = model_path
        self.signature = signature
        self.input_key = input_key
        self.output_key = output_key

    def load_model(self):
        import tensorflow as tf

        loaded = tf.saved_model.load(self.model_path)
        if self.signature not in loaded.signatures:
            raise ValueError(f"the SavedModel at {self.model_path!r} has no signature "
                             f"{self.signature!r}; it has {sorted(loaded.signatures)}.")
        fn = loaded.signatures[self.signature]
        _, inputs = fn.structured_input_signature
        if self.input_key is None:
            strings = [k for k, spec in inputs.items() if spec.dtype == tf.string]
            if len(strings) != 1:
                raise ValueError(f"cannot tell which input of {self.signature!r} takes image "
                                 f"bytes (inputs {sorted(inputs)}); pass --input_key.")
            self.input_key = strings[0]
        if self.output_key is None:
            outs = sorted(fn.structured_outputs)
            self.output_key = outs[0] if len(outs) == 1 else "embedding"
            if self.output_key not in outs:
                raise ValueError(f"{self.signature!r} returns {outs}; pass --output_key.")
        return _LoadedModel(loaded, fn)

    def _call(self, model, data: Sequence[bytes]):
        import tensorflow as tf

        out = model.fn(**{self.input_key: tf.constant(list(data), tf.string)})
        return out[self.output_key].numpy()

    def run_inference(self, batch: Sequence[bytes], model, inference_args=None
                      ) -> Iterable[PredictionResult]:
        import tensorflow as tf

        try:
            embeddings = self._call(model, batch)
            return [PredictionResult(x, e) for x, e in zip(batch, embeddings)]
        except tf.errors.InvalidArgumentError:
            results = []
            for x in batch:
                try:
                    results.append(PredictionResult(x, self._call(model, [x])[0]))
                except tf.errors.InvalidArgumentError as e:
                    results.append(PredictionResult(x, {"error": _error_line(e.message)}))
            return results

    def get_num_bytes(self, batch: Sequence[bytes]) -> int:
        return sum(len(x) for x in batch)

    def get_metrics_namespace(self) -> str:
        return "tfaploss.embed.RunInference"


def _error_line(message: str) -> str:
    """The informative line of a TensorFlow error (the first is often just "Graph
    execution error:")."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for ln in lines:
        if "decode" in ln.lower() or "invalid" in ln.lower():
            return ln[:500]
    return " ".join(lines[:2])[:500]


def _gfile():
    import tensorflow as tf

    return tf.io.gfile


def list_inputs(input_path: str, input_format: str = "auto"):
    """``("tfrecord", files)`` or ``("images", [(path, relpath), ...])``."""
    gfile = _gfile()
    if gfile.isdir(input_path):
        records = sorted(gfile.glob(os.path.join(input_path, "*.tfrecord*")))
        if input_format in ("auto", "tfrecord") and records:
            return "tfrecord", records
        if input_format == "tfrecord":
            raise FileNotFoundError(f"no *.tfrecord* files in {input_path!r}.")
        images = []
        for root, _, files in gfile.walk(input_path):
            for name in files:
                if name.lower().endswith(IMAGE_EXTENSIONS):
                    path = os.path.join(root, name)
                    images.append((path, os.path.relpath(path, input_path)))
        if not images:
            raise FileNotFoundError(f"no TFRecords or images ({', '.join(IMAGE_EXTENSIONS)}) "
                                    f"under {input_path!r}.")
        return "images", sorted(images)
    matches = sorted(gfile.glob(input_path))
    if not matches:
        raise FileNotFoundError(f"--input {input_path!r} matches no file.")
    is_records = input_format == "tfrecord" or (
        input_format == "auto" and not all(m.lower().endswith(IMAGE_EXTENSIONS) for m in matches))
    if is_records:
        return "tfrecord", matches
    root = os.path.commonpath([os.path.dirname(m) for m in matches])
    return "images", [(m, os.path.relpath(m, root)) for m in matches]


def parse_image_record(serialized: bytes) -> dict[str, Any]:
    """``{"id", "label", "data", "path"}`` from a ``tf.train.Example`` of the pipelines'
    schema."""
    from tensorflow.core.example import example_pb2

    f = example_pb2.Example.FromString(serialized).features.feature

    def first(key: str, kind: str, default):
        values = getattr(f[key], kind).value if key in f else ()
        return values[0] if values else default

    image_id = first("image/id", "bytes_list", None)
    return {"id": image_id.decode("utf-8") if image_id is not None else None,
            "label": int(first("image/class/label", "int64_list", -1)),
            "data": first("image/encoded", "bytes_list", None),
            "path": first("image/path", "bytes_list", b"").decode("utf-8")}


def _failed(image_id, path: str, reason: str):
    return beam.pvalue.TaggedOutput("failed", {"id": image_id, "path": path, "reason": reason})


class ParseRecordDoFn(beam.DoFn):
    """TFRecord bytes -> ``((id, label), image bytes)``; records without id or image go to
    the dead letters."""

    def process(self, serialized: bytes):
        try:
            rec = parse_image_record(serialized)
        except Exception as e:  # noqa: BLE001 - a corrupt record is reported, not fatal
            yield _failed(None, "", f"unparsable record: {e}")
            return
        if rec["id"] is None or not rec["data"]:
            missing = "image/id" if rec["id"] is None else "image/encoded"
            yield _failed(rec["id"], rec["path"], f"record lacks {missing}")
            return
        yield (rec["id"], rec["label"]), rec["data"]


class ReadImageDoFn(beam.DoFn):
    """``(path, id, label)`` -> ``((id, label), file bytes)``; unreadable/empty files go to
    the dead letters."""

    def process(self, item):
        from apache_beam.io.filesystems import FileSystems

        path, image_id, label = item
        try:
            with FileSystems.open(path) as f:
                data = f.read()
        except Exception as e:  # noqa: BLE001
            yield _failed(image_id, path, f"unreadable: {e}")
            return
        if not data:
            yield _failed(image_id, path, "empty file")
            return
        yield (image_id, label), data


class ToExampleDoFn(beam.DoFn):
    """``((id, label), PredictionResult)`` -> serialised embedding record, or a dead
    letter when the model refused the image."""

    def __init__(self):
        self.ok = beam.metrics.Metrics.counter(_COUNTER_NS, "embedded")

    def setup(self):
        self.fault_after = faults.threshold("images")  # crash tests only; 0: never
        self.done = 0

    def process(self, keyed):
        from tfaploss.evaluation.embedding_files import embedding_example

        (image_id, label), result = keyed
        inference = result.inference
        if isinstance(inference, dict) and "error" in inference:
            yield _failed(image_id, "", inference["error"])
            return
        self.ok.inc()
        self.done += 1
        if self.fault_after:
            faults.count_reached("images", self.fault_after, self.done)
        yield embedding_example(inference, image_id, label)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tfaploss.pipelines.embed", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Other options go to Apache Beam (--runner, --project, --temp_location, "
               "--setup_file ./setup.py, --direct_num_workers, ...).")
    p.add_argument("--input", required=True,
                   help="TFRecord directory/glob, or image directory/glob")
    p.add_argument("--model", required=True, help="SavedModel directory (a version folder)")
    p.add_argument("--output", required=True, help="output directory")
    opts.add_options(p, (
        ("--input_format", ("auto", "tfrecord", "images"), "auto", None),
        ("--labels_from_folders", bool, False,
         "image files: label = index of the top-level folder (sorted)"),
        ("--signature", str, "serving_default", None),
        ("--input_key", str, None,
         "signature input taking image bytes (default: its only string input)"),
        ("--output_key", str, None,
         "signature output holding the embedding (default: the only output, else 'embedding')"),
        ("--batch_size", int, 32, "largest RunInference batch"),
        ("--num_shards", int, 0, "output shards (0: Beam decides)"),
        ("--max_failure_fraction", float, 0.01, None),
        ("--verbose", bool, False, "also show Beam's INFO logging"),
    ))
    return p


def run(argv: list[str] | None = None) -> dict:
    """Run the job in-process; returns the manifest (also written to ``--output``)."""
    args, beam_argv = build_parser().parse_known_args(argv)
    if args.batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}")
    opts.check_failure_fraction(args.max_failure_fraction)
    gfile = _gfile()
    if not gfile.exists(os.path.join(args.model, "saved_model.pb")):
        raise FileNotFoundError(f"--model {args.model!r} is not a SavedModel directory "
                                "(no saved_model.pb); pass the version folder, e.g. export/1.")
    kind, inputs = list_inputs(args.input, args.input_format)
    final = args.output.rstrip("/")
    parent, base = os.path.split(final)
    storage.makedirs(parent or ".")
    stage = storage.join(parent or ".", f".{base}.incoming")
    # One job per output (tfaploss.durable.locks); the lock sits beside it, as the output
    # folder itself is swapped whole when published.
    with locks.exclusive(parent or ".", "output", name=f".{base}.tfaploss.lock",
                         target=final), storage.disk_full_whole(stage):
        return _embed(args, beam_argv, gfile, kind, inputs, final, stage)


def _embed(args, beam_argv, gfile, kind, inputs, final, stage) -> dict:
    storage.recover(final)
    storage.check_owned(final)
    storage.remove_tree(stage)  # what a killed run left; never the live output
    storage.makedirs(stage)

    handler = KeyedModelHandler(SavedModelBytesHandler(
        args.model, args.signature, args.input_key, args.output_key,
        max_batch_size=args.batch_size))
    pipeline = beam.Pipeline(options=PipelineOptions(beam_argv))
    if kind == "tfrecord":
        raw = pipeline | "ListRecords" >> beam.Create(inputs) | "ReadRecords" >> (
            beam.io.ReadAllFromTFRecord())
        parsed = raw | "Parse" >> beam.ParDo(ParseRecordDoFn()).with_outputs(
            "failed", main="ok")
    else:
        folders = sorted({rel.split(os.sep)[0] for _, rel in inputs if os.sep in rel})
        label_of = {name: i for i, name in enumerate(folders)}
        items = [(path, rel, label_of.get(rel.split(os.sep)[0], -1)
                  if args.labels_from_folders else -1) for path, rel in inputs]
        parsed = (pipeline | "ListImages" >> beam.Create(items)
                  | "ReadImages" >> beam.ParDo(ReadImageDoFn()).with_outputs(
                      "failed", main="ok"))
    embedded = (parsed.ok | "RunInference" >> RunInference(handler)
                | "ToExample" >> beam.ParDo(ToExampleDoFn()).with_outputs(
                    "failed", main="ok"))
    _ = embedded.ok | "WriteEmbeddings" >> beam.io.WriteToTFRecord(
        os.path.join(stage, "embeddings"), file_name_suffix=".tfrecord",
        num_shards=args.num_shards)
    _ = ((parsed.failed, embedded.failed) | "AllFailures" >> beam.Flatten()
         | "FailuresToJson" >> beam.Map(functools.partial(json.dumps, sort_keys=True))
         | "WriteFailures" >> beam.io.WriteToText(
             os.path.join(stage, DEAD_LETTERS), shard_name_template="",
             num_shards=1))
    result = _run_checked(pipeline, kind, inputs)

    dead_path = os.path.join(stage, DEAD_LETTERS)
    failures = []
    if gfile.exists(dead_path):
        with gfile.GFile(dead_path, "r") as f:
            failures = [json.loads(line) for line in f if line.strip()]
    shards = sorted(os.path.basename(p)
                    for p in gfile.glob(os.path.join(stage, "embeddings-*")))
    embedded_count = _embedded_count(result, shards, stage)
    total = embedded_count + len(failures)
    manifest = {
        "input": args.input, "input_format": kind, "model": args.model,
        "signature": args.signature, "num_embedded": embedded_count,
        "num_failures": len(failures), "num_inputs": (kind == "images" and len(inputs)) or total,
        "shards": shards, "dead_letters": DEAD_LETTERS,
        "format": "tfaploss.evaluation.embedding_files",
    }
    storage.write_json(os.path.join(stage, MANIFEST), manifest, indent=1, sort_keys=True,
                       fault="manifest")
    storage.publish(stage, final)
    LOG.info("embedded %d images, %d failures -> %s", embedded_count, len(failures),
             args.output)
    if total and len(failures) > args.max_failure_fraction * total:
        raise TooManyFailuresError(
            f"{len(failures)} of {total} inputs failed (more than --max_failure_fraction="
            f"{args.max_failure_fraction}); see {os.path.join(final, DEAD_LETTERS)}",
            {"embed": manifest})
    return manifest


def _run_checked(pipeline, kind, inputs):
    """Run the pipeline; a damaged input record file ends it, before or during the run,
    with one DamagedDataError naming the file, the record and the command that rebuilds
    it (a record that parses but holds no image is a dead letter)."""
    from tfaploss.data import integrity
    from tfaploss.data.record_checks import scan_shard
    from tfaploss.data.split_manifest import is_job_output

    splits = sorted({integrity.split_dir_of(p) for p in inputs}) if kind == "tfrecord" else []
    # One CRC pass over the inputs before the job: far cheaper than the inference that
    # follows, and a damaged file is named before Beam logs its retries' tracebacks.
    for split in splits:
        if is_job_output(split):
            integrity.check_or_raise(split, "full", layouts=("images",), what="embedding")
    for path in inputs if kind == "tfrecord" else []:
        if "://" not in path and not is_job_output(integrity.split_dir_of(path)):
            _, damage = scan_shard(path)
            if damage is not None:
                raise integrity.damaged_error(integrity.split_dir_of(path), damage,
                                              what="embedding")
    try:
        result = pipeline.run()
        result.wait_until_finish()
    except Exception as err:
        if atomic.disk_full_in(err, ".") is not None:
            raise  # not the inputs: no scan of them
        found = integrity.locate(splits, what="embedding", level="full") if splits else None
        if found is None:
            raise
        raise found from None
    return result


def _embedded_count(result, shards, output_dir) -> int:
    """The ``embedded`` counter; runners without metrics get the records counted."""
    from apache_beam.metrics.metric import MetricsFilter

    try:
        counters = result.metrics().query(
            MetricsFilter().with_namespace(_COUNTER_NS).with_name("embedded"))["counters"]
        if counters:
            return int(sum(c.committed or 0 for c in counters))
    except (NotImplementedError, AttributeError, KeyError):
        pass
    import tensorflow as tf

    return sum(1 for name in shards
               for _ in tf.data.TFRecordDataset(os.path.join(output_dir, name)))


def main(argv: list[str] | None = None) -> int:
    return main_wrapper(
        run, argv,
        describe=lambda m: (f"{m['num_embedded']} embeddings, {m['num_failures']} failures -> "
                            f"{m['shards'][:1]}..."))


if __name__ == "__main__":
    sys.exit(main())
