"""The TFDS source job on a tiny dataset prepared in a temporary data_dir."""

import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from tests.support import miniature as mini
from tfaploss.pipelines import tfds_source


class TinyRetrievalSet(tfds.core.GeneratorBasedBuilder):
    """4 classes x 3 images in 'train', 4 x 2 in 'test' (like cars196's label split)."""

    VERSION = tfds.core.Version("1.0.0")
    # Nothing to download; skip TFDS's checksum-file lookup next to the builder's code.
    url_infos: dict = {}  # noqa: RUF012

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(names=["ant", "bee", "cat", "dog"]),
                "file_name": tfds.features.Text(),
            }))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(3, "tr"), "test": self._generate_examples(2, "te")}

    def _generate_examples(self, per_class, prefix):
        for k in range(4):
            for n in range(per_class):
                pixels = np.zeros((mini.H, mini.W, 3), np.uint8)
                pixels[:] = mini.class_colour(k)
                name = f"{prefix}_{k}_{n}.jpg"
                yield name, {"image": pixels, "label": k, "file_name": name}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tfds"))
    TinyRetrievalSet(data_dir=d).download_and_prepare()
    return d


def test_tfds_split_classes_pools_splits_and_relabels(data_dir, tmp_path):
    out = str(tmp_path / "out")
    manifests = tfds_source.run([
        "--dataset", "tiny_retrieval_set", "--data_dir", data_dir, "--output_dir", out,
        "--split_classes", "2", "--id_key", "file_name", "--read_shards", "1",
        "--direct_running_mode", "in_memory"])
    for split, classes in (("train", [0, 1]), ("test", [2, 3])):
        records = mini.read_examples(os.path.join(out, split))
        got = {r["image/id"][0].decode(): r["image/class/label"][0] for r in records}
        want = {f"{p}_{k}_{n}.jpg": classes.index(k) for k in classes
                for p, per in (("tr", 3), ("te", 2)) for n in range(per)}
        assert got == want
        m = manifests[split]
        assert m["num_images"] == 10 and m["num_failures"] == 0
        assert m["label_map"] == {str(i): ["ant", "bee", "cat", "dog"][k]
                                  for i, k in enumerate(classes)}
        for r in records:
            k = classes[r["image/class/label"][0]]
            img = mini.decode(r["image/encoded"][0])
            np.testing.assert_allclose(img[12, 16], mini.class_colour(k), atol=6)
    assert manifests["train"]["by_class"] and manifests["test"]["by_class"] is None


def test_tfds_unknown_split_or_feature_is_named(data_dir, tmp_path):
    base = ["--dataset", "tiny_retrieval_set", "--data_dir", data_dir,
            "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match="has no split 'validation'"):
        tfds_source.run(base + ["--splits", "validation"])
    with pytest.raises(ValueError, match="has no feature 'class_id'"):
        tfds_source.run(base + ["--label_key", "class_id"])
