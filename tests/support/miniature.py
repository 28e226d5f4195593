"""Miniature copies of each dataset's real file layout, for the pipeline tests.

Every generator writes a few dozen small generated JPEGs in the dataset's real folder
structure with its real annotation format, plus the troublemakers every job must
survive: one corrupt (truncated) image, one file the annotations list but that does
not exist, one CMYK JPEG, one grayscale JPEG and one JPEG whose EXIF orientation says
"rotate 90 degrees". Each returns a :class:`Mini` describing what a correct job writes.

Pixels encode the class (a flat colour per class) and a red 6x6 marker in the stored
top-left corner, so tests can check colour conversion and EXIF rotation after decoding.
"""

from __future__ import annotations

import csv
import hashlib
import os
import pickle
import time
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

W, H = 32, 24  # stored size of every generated image (EXIF one: displayed 24 x 32)


@dataclass
class Mini:
    """What a job should produce from a miniature dataset, per output split."""

    root: str
    ok: dict[str, dict[str, int]] = field(default_factory=dict)     # split -> {id: label}
    failed: dict[str, dict[str, str]] = field(default_factory=dict)  # split -> {id: reason}
    special: dict[str, str] = field(default_factory=dict)  # exif/cmyk/gray -> id
    super_labels: dict[str, dict[str, int]] = field(default_factory=dict)  # split -> {id: s}

    def expect(self, split, image_id, label, super_label=None):
        self.ok.setdefault(split, {})[image_id] = label
        if super_label is not None:
            self.super_labels.setdefault(split, {})[image_id] = super_label

    def fail(self, split, image_id, reason):
        self.failed.setdefault(split, {})[image_id] = reason


def class_colour(k: int) -> tuple[int, int, int]:
    rng = np.random.default_rng(1000 + k)
    return tuple(int(v) for v in rng.integers(40, 200, size=3))


def _pixels(k: int) -> np.ndarray:
    a = np.empty((H, W, 3), np.uint8)
    a[:] = class_colour(k)
    a[:6, :6] = (255, 0, 0)
    return a


def write_image(path: str, k: int, kind: str = "rgb") -> None:
    """Write one image of class ``k``: kind in rgb, png, cmyk, gray, exif, corrupt, empty."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img = Image.fromarray(_pixels(k))
    if kind == "png":
        img.save(path, format="PNG")
    elif kind == "rgb":
        img.save(path, format="JPEG", quality=95)
    elif kind == "cmyk":
        img.convert("CMYK").save(path, format="JPEG", quality=95)
    elif kind == "gray":
        img.convert("L").save(path, format="JPEG", quality=95)
    elif kind == "exif":
        exif = Image.Exif()
        exif[0x0112] = 6  # orientation: display rotated 90 degrees clockwise
        img.save(path, format="JPEG", quality=95, exif=exif.tobytes())
    elif kind == "corrupt":
        img.save(path, format="JPEG", quality=95)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])  # truncated mid-scan
    elif kind == "empty":
        open(path, "wb").close()
    else:
        raise ValueError(f"unknown kind {kind!r}")


# Position (within a split's listing) of each troublemaker; the rest are plain JPEGs.
TROUBLE = {1: "corrupt", 2: "missing", 3: "cmyk", 4: "gray", 5: "exif"}
FAIL_REASON = {"corrupt": "truncated", "missing": "missing_file"}


def _emit(mini: Mini, split: str, idx: int, image_id: str, path: str, k: int, label: int,
          super_label=None, trouble=True) -> None:
    kind = TROUBLE.get(idx, "rgb") if trouble else "rgb"
    if kind != "missing":
        write_image(path, k, kind)
    if kind in FAIL_REASON:
        mini.fail(split, image_id, FAIL_REASON[kind])
    else:
        mini.expect(split, image_id, label, super_label)
        if kind in ("cmyk", "gray", "exif"):
            mini.special[kind] = image_id


def make_folder(root: str, num_classes: int = 6, per_class: int = 5) -> Mini:
    """``root/<class>/<n>.jpg|png``; class "3" is PNG (the demo writes PNGs)."""
    mini = Mini(root)
    idx = 0
    for k in range(num_classes):
        for n in range(per_class):
            ext = "png" if k == 3 else "jpg"
            rel = f"{k}/img{n:02d}.{ext}"
            path = os.path.join(root, rel)
            if ext == "png":
                write_image(path, k, "png")
                mini.expect("all", rel, k)
            else:
                _emit(mini, "all", idx, rel, path, k, k)
                if TROUBLE.get(idx) == "missing":
                    # a walked tree cannot list a missing file, but it can hold a broken link
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.symlink(os.path.join(root, "nowhere", "gone.jpg"), path)
            idx += 1
    with open(os.path.join(root, "README.txt"), "w") as f:
        f.write("not an image\n")
    return mini


SOP_SUPERS = ["bicycle_final", "chair_final", "lamp_final"]


def make_sop(root: str, classes_per_split: int = 6, per_class: int = 3) -> Mini:
    """``Ebay_train.txt`` / ``Ebay_test.txt`` + ``<super>_final/<id>_<n>.JPG``.

    Class ids are 1-based and test classes follow train classes; a duplicated row and a
    malformed row are appended to the train file.
    """
    mini = Mini(root)
    image_id = 1
    for split_i, split in enumerate(("train", "test")):
        rows = ["image_id class_id super_class_id path"]
        idx = 0
        for c in range(classes_per_split):
            class_id = split_i * classes_per_split + c + 1
            super_id = c % len(SOP_SUPERS) + 1
            for n in range(per_class):
                rel = f"{SOP_SUPERS[super_id - 1]}/{100000 + class_id}_{n}.JPG"
                rows.append(f"{image_id} {class_id} {super_id} {rel}")
                _emit(mini, split, idx, str(image_id), os.path.join(root, rel),
                      class_id, c, super_label=super_id - 1)
                image_id += 1
                idx += 1
        if split == "train":
            rows.append(rows[1])  # duplicate id
            rows.append("999 notanumber 1 bicycle_final/x.JPG")
            mini.fail(split, "1", "duplicate_id")
            mini.fail(split, "line", "bad_annotation")
        with open(os.path.join(root, f"Ebay_{split}.txt"), "w") as f:
            f.write("\n".join(rows) + "\n")
    return mini


INAT_SUPERS = ["Aves", "Plantae"]


def make_inaturalist(root: str, classes_per_split: int = 4, per_class: int = 4) -> Mini:
    """``train_val2018/<super>/<category id>/<hash>.jpg`` + the two split lists."""
    mini = Mini(root)
    for split_i, split in enumerate(("train", "test")):
        lines = []
        idx = 0
        for c in range(classes_per_split):
            cat = 5000 + 10 * (split_i * classes_per_split + c)
            sup = INAT_SUPERS[c % 2]
            for n in range(per_class):
                rel = f"train_val2018/{sup}/{cat}/{cat:05d}{n:027x}.jpg"
                lines.append(rel)
                _emit(mini, split, idx, rel, os.path.join(root, rel), cat, c,
                      super_label=INAT_SUPERS.index(sup))
                idx += 1
        with open(os.path.join(root, f"Inaturalist_{split}_set1.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return mini


def write_square_classes(root, classes: int, per_class: int, seed: int = 0) -> None:
    """Class folders ``c0``, ``c1``, ... of 16x16 PNGs: class k is a bright square at a
    class-specific place, plus noise; learnable in a few steps (the command tests)."""
    rng = np.random.default_rng(seed)
    for k in range(classes):
        os.makedirs(os.path.join(root, f"c{k}"))
        y, x = divmod(k, 3)
        for i in range(per_class):
            img = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
            img[4 * y + 1:4 * y + 8, 4 * x + 1:4 * x + 8] = 230
            Image.fromarray(img).save(os.path.join(root, f"c{k}", f"{i}.png"))


def _gld_id(n: int) -> str:
    return f"{(n * 2654435761) % (16 ** 16):016x}"


def _gld_path(root: str, folder: str, image_id: str) -> str:
    return os.path.join(root, folder, image_id[0], image_id[1], image_id[2], image_id + ".jpg")


def make_gldv2(root: str, num_classes: int = 5, per_class: int = 5) -> Mini:
    """``train.csv`` + ``train_clean.csv`` + ``train/a/b/c/<id>.jpg``, and the retrieval
    files ``index_image_to_landmark.csv``, ``retrieval_solution_v2.1.csv`` with
    ``index/`` and ``test/`` images. Landmark 7000 has a single image (for
    ``--min_images_per_class``). Expectations are for ``train.csv`` (split "train")
    and the retrieval subset (splits "index", "test")."""
    mini = Mini(root)
    rows, clean = [], []
    idx = 0
    landmarks = [1000 + 37 * c for c in range(num_classes)]
    for c, lm in enumerate(landmarks):
        ids = []
        for n in range(per_class):
            image_id = _gld_id(idx + 1)
            ids.append(image_id)
            rows.append([image_id, f"http://example.com/{image_id}.jpg", str(lm)])
            _emit(mini, "train", idx, image_id, _gld_path(root, "train", image_id), c, c)
            idx += 1
        clean.append([str(lm), " ".join(ids)])
    lonely = _gld_id(999)
    rows.append([lonely, "http://example.com/x.jpg", "7000"])
    write_image(_gld_path(root, "train", lonely), 9)
    mini.expect("train", lonely, num_classes)
    with open(os.path.join(root, "train.csv"), "w", newline="") as f:
        csv.writer(f).writerows([["id", "url", "landmark_id"], *rows])
    with open(os.path.join(root, "train_clean.csv"), "w", newline="") as f:
        csv.writer(f).writerows([["landmark_id", "images"], *clean])

    index_rows, solution = [], []
    for c, lm in enumerate(landmarks[:3]):
        for n in range(3):
            image_id = _gld_id(5000 + 10 * c + n)
            index_rows.append([image_id, str(lm)])
            _emit(mini, "index", 3 * c + n, image_id, _gld_path(root, "index", image_id), c,
                  c, trouble=(3 * c + n) in (1, 3))  # one corrupt, one CMYK
    for q in range(4):
        image_id = _gld_id(9000 + q)
        if q < 3:
            relevant = " ".join(r[0] for r in index_rows[3 * q: 3 * q + 3])
            mini.expect("test", image_id, q)
        else:
            relevant = "None"  # a non-landmark query: left out by default
        solution.append([image_id, relevant, "Public" if q % 2 else "Private"])
        write_image(_gld_path(root, "test", image_id), q)
    with open(os.path.join(root, "index_image_to_landmark.csv"), "w", newline="") as f:
        csv.writer(f).writerows([["id", "landmark_id"], *index_rows])
    with open(os.path.join(root, "retrieval_solution_v2.1.csv"), "w", newline="") as f:
        csv.writer(f).writerows([["id", "images", "Usage"], *solution])
    return mini


def make_revisited(root: str, dataset: str = "roxford5k", num_db: int = 12,
                   num_queries: int = 3) -> tuple[Mini, dict]:
    """``gnd_<dataset>.pkl`` (Python-2 style pickle with numpy arrays) + ``jpg/<name>.jpg``.

    Returns the Mini (labels are -1) and the ground-truth dict that was pickled.
    """
    mini = Mini(root)
    imlist = [f"{dataset[1:-2]}_{i:06d}" for i in range(num_db)]
    qimlist = [imlist[i] for i in range(0, num_queries * 2, 2)]
    gnd = []
    for q in range(num_queries):
        gnd.append({
            "bbx": np.array([4.0, 2.5, 20.0, 18.0 + q]),
            "easy": np.array([q + 1, q + 5], dtype=np.int64),
            "hard": np.array([q + 3], dtype=np.int64),
            "junk": np.array([], dtype=np.int64),
        })
    for i, name in enumerate(imlist):
        _emit(mini, "database", i, name, os.path.join(root, "jpg", name + ".jpg"), i % 5, -1)
    for q, name in enumerate(qimlist):
        if name in mini.ok["database"]:
            mini.expect("queries", name, -1)
        else:
            mini.fail("queries", name, mini.failed["database"][name])
    truth = {"imlist": imlist, "qimlist": qimlist, "gnd": gnd}
    with open(os.path.join(root, f"gnd_{dataset}.pkl"), "wb") as f:
        pickle.dump(truth, f, protocol=2)
    return mini, truth


def write_split_records(split_dir: str, class_sizes: dict[int, int],
                        super_labels: dict[int, int] | None = None, chunk_size: int = 8,
                        size: tuple[int, int] = (W, H), image_fn=None) -> dict:
    """Write a split the way the Beam jobs lay it out, without Beam (fast sampler tests).

    Image ``f"{label}/{n}"`` is a flat JPEG of the class colour, or
    ``image_fn(label, size)`` (a PIL image) when given. Writes
    ``images-00000-of-00001.tfrecord``, ``by_class/classes-00000-of-00001.tfrecord``
    and ``manifest.json``; returns the manifest.
    """
    import io
    import json

    import tensorflow as tf

    from tfaploss.pipelines import tf_example as X

    super_labels = super_labels or {}
    os.makedirs(os.path.join(split_dir, "by_class"), exist_ok=True)
    with tf.io.TFRecordWriter(os.path.join(split_dir, "images-00000-of-00001.tfrecord")) as w1, \
            tf.io.TFRecordWriter(os.path.join(split_dir, "by_class",
                                              "classes-00000-of-00001.tfrecord")) as w2:
        index = 0
        for label, n in sorted(class_sizes.items()):
            buf = io.BytesIO()
            image = (image_fn(label, size) if image_fn else
                     Image.new("RGB", size, class_colour(label)))
            image.save(buf, format="JPEG", quality=95)
            jpeg = buf.getvalue()
            items = []
            for i in range(n):
                image_id = f"{label}/{i}"
                record = {"id": image_id, "path": image_id, "index": index, "label": label,
                          "super_label": super_labels.get(label, -1), "class_text": str(label)}
                w1.write(X.image_example(record, jpeg, size[1], size[0]))
                items.append((image_id, super_labels.get(label, -1), jpeg))
                index += 1
            for chunk in X.class_chunk_examples(label, items, chunk_size):
                w2.write(chunk)
    manifest = {
        "class_counts": {str(k): v for k, v in sorted(class_sizes.items())},
        "class_super_labels": {str(k): v for k, v in sorted(super_labels.items())},
        "by_class": {"chunk_size": chunk_size, "shards": ["by_class/classes-00000-of-00001"]},
        "num_images": sum(class_sizes.values()),
    }
    with open(os.path.join(split_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return manifest


def read_examples(split_dir: str, layout: str = "images") -> list[dict]:
    """Parse every record of a split into ``{feature: list of values}`` (test helper)."""
    import glob

    import tensorflow as tf

    pattern = ("images-*.tfrecord" if layout == "images"
               else os.path.join("by_class", "classes-*.tfrecord"))
    out = []
    for path in sorted(glob.glob(os.path.join(split_dir, pattern))):
        for raw in tf.data.TFRecordDataset(path).as_numpy_iterator():
            ex = tf.train.Example.FromString(raw)
            row = {}
            for key, feat in ex.features.feature.items():
                kind = feat.WhichOneof("kind")
                row[key] = list(getattr(feat, kind).value)
            out.append(row)
    return out


def read_dead_letters(split_dir: str) -> list[dict]:
    import json

    with open(os.path.join(split_dir, "dead_letters.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def decode(jpeg: bytes) -> np.ndarray:
    import io

    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))


def processes_running_with(arg, wait=5.0):
    """Pids of live processes with ``arg`` on their command line (a job's image workers),
    after up to ``wait`` s for them to go (a dying process takes a moment)."""
    deadline = time.time() + wait
    while True:
        pids = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if arg.encode() in f.read().split(b"\0"):
                        pids.append(int(entry))
            except (OSError, ValueError):
                continue
        if not pids or time.time() > deadline:
            return pids
        time.sleep(0.1)


def snapshot(folder) -> dict[str, str]:
    """{relative path: SHA-256} of every file below ``folder`` (to compare two runs, or
    a folder before and after something that must not change it)."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out
