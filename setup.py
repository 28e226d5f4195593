"""Packaging entry point for tfaploss.

Installs one top-level package, ``tfaploss``: losses, training, data, evaluation,
export and the CLI, with ``tfaploss.models`` (backbones, pooling, heads, whitening)
and ``tfaploss.pipelines`` (the Apache Beam preprocessing jobs) inside it, so that a
user's own ``models.py`` or ``pipelines/`` never shadows ours. A Beam job ships it to
its workers with ``--setup_file ./setup.py``.

The recipes live in ``configs/`` (the repository's layout); the build copies them into
the wheel as ``tfaploss/recipes/*.yaml`` (:class:`BuildPyWithRecipes`), and MANIFEST.in
puts ``configs/`` in the sdist, so a wheel built from either has them and
``--config recipe:NAME`` works without a clone (tfaploss/config/recipes.py finds them).
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# google-crc32c: the record CRCs at ~10 GB/s instead of crcmod's ~0.5 GB/s.
# fonttools: pipelines.glyphs reads the fonts' cmaps and outlines with it.
BEAM = ["apache-beam[tfrecord]>=2.60", "google-crc32c>=1.5", "fonttools>=4.40"]
# The jobs on a Dask cluster (--runner apache_beam.runners.dask.dask_runner.DaskRunner):
# Beam's own dask and distributed requirements.
DASK = ["apache-beam[dask]>=2.60"]
# scann 1.4.2 loads TensorFlow ops built for 2.20 (`import scann` fails on 2.21): the one
# place tfaploss pins TensorFlow's minor.
SCANN = ["scann==1.4.2; platform_system == 'Linux'", "tensorflow>=2.20,<2.21"]
# faiss: exact and approximate search on every platform (faiss-gpu users install it).
FAISS = ["faiss-cpu>=1.8"]
# keras-hub: pretrained backbones (model.backbone: keras_hub:<preset>). It requires
# tensorflow-text, whose release follows TensorFlow's minor.
HUB = ["keras-hub>=0.22"]
TFDS = ["tensorflow-datasets>=4.9", "importlib_resources"]
# umap-learn: the optional UMAP view of the embeddings (tfaploss.callbacks.umap_figure).
VIZ = ["matplotlib>=3.7", "umap-learn>=0.5"]
DEMO = ["scikit-learn>=1.3"]
# import-linter: the layer and cycle contracts in pyproject.toml (tests/test_architecture.py).
TEST = ["pytest>=8", "pytest-xdist>=3", "import-linter>=2.1", "hypothesis>=6.100"]
# tfaploss compare: Optuna's TPE sampler tunes every loss alike.
COMPARE = ["optuna>=3.6"]
# benchmarks/: faiss beside ScaNN (search.py), the PyTorch peers of the losses (losses.py).
BENCH = FAISS + ["torch", "pytorch-metric-learning>=2.9"]



class BuildPyWithRecipes(build_py):
    """``build_py``, then ``configs/*.yaml`` copied into the build as
    ``tfaploss/recipes/*.yaml``. An editable install skips the copy: it runs from the
    clone, whose ``configs/`` the recipe lookup reads directly."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        recipes = sorted(Path("configs").glob("*.yaml"))
        if not recipes:  # a build from a tree that lost them must not ship a bare wheel
            raise SystemExit("setup.py: no configs/*.yaml to ship as tfaploss/recipes/ "
                             "(an sdist built without MANIFEST.in?)")
        target = Path(self.build_lib) / "tfaploss" / "recipes"
        self.mkpath(str(target))
        for recipe in recipes:
            self.copy_file(str(recipe), str(target / recipe.name))


setup(
    name="tfaploss",
    version="0.1.0",
    description=(
        "Train image-retrieval embeddings in Keras 3 by directly optimising "
        "Average Precision: the AP losses of the literature and their peers, large "
        "batches, Beam pipelines, search and serving."
    ),
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["tfaploss", "tfaploss.*"]),
    include_package_data=True,
    # make data-glyphs runs it from a clone; an installed tfaploss carries it too.
    package_data={"tfaploss.pipelines": ["fetch_fonts.sh"]},
    cmdclass={"build_py": BuildPyWithRecipes},
    install_requires=[
        # The TensorFlow minors tested: 2.20 by `make test` (everything, with ScaNN, which
        # caps it: the SCANN extra), 2.21 by `make test-tf221` (the tests not marked slow,
        # without ScaNN, keras-hub, JAX or PyTorch). Widen after testing the next minor.
        "tensorflow>=2.20,<2.22",
        # The minors tested (tests/test_keras_compat.py and the multi-backend tests on
        # TensorFlow, JAX and PyTorch): 3.14 and 3.15. Not 3.13 or older: the smooth-rank
        # kernels use keras.ops.scatter_update(..., reduction="add"), new in 3.14.
        # tfaploss also uses a few private Keras names (tfaploss/_keras_compat.py) that
        # a minor release may move: widen the upper bound only after testing that minor.
        "keras>=3.14,<3.16",
        # TensorBoard logs of every run (tf.summary); TensorFlow 2.21 no longer pulls it in.
        "tensorboard>=2.20",
        "numpy>=2",
        "pyyaml>=6",
        "pillow>=10",
        # lets exact search run its selection threads with single-threaded BLAS
        "threadpoolctl>=3",
    ],
    extras_require={
        "beam": BEAM,
        "dask": BEAM + DASK,
        "scann": SCANN,
        "faiss": FAISS,
        "hub": HUB,
        "tfds": TFDS,
        "viz": VIZ,
        "compare": COMPARE + VIZ,
        "bench": BENCH,
        "demo": DEMO + BEAM + VIZ,
        "all": BEAM + SCANN + FAISS + HUB + TFDS + VIZ + DEMO + COMPARE + ["jax[cpu]"],
        # The test tools alone: `make test-tf221` adds them to the extras TensorFlow 2.21 takes.
        "test": TEST,
        "dev": (BEAM + DASK + SCANN + FAISS + HUB + TFDS + VIZ + DEMO + COMPARE + TEST
                + ["ruff", "jax[cpu]"]),
    },
    entry_points={"console_scripts": ["tfaploss=tfaploss.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
