"""Entry point of the Bazel `py_test` targets: runs pytest on the given files.

Each `py_test` in BUILD names this file as its `main` and passes its test
file as an argument, e.g. `args = ["$(location tests/test_x.py)"]`. Bazel
starts tests in the runfiles root, where that path resolves. Outside Bazel,
`python tests/pytest_main.py [FILES...]` does the same (default: tests/).
"""

import os
import sys

import pytest


def main(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = ["-q", "-p", "no:cacheprovider"]  # runfiles are not ours to write
    if os.environ.get("XML_OUTPUT_FILE"):  # set by `bazel test`
        args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    # Any non-zero code fails the target, including 5 (no test collected).
    return int(pytest.main(args + (argv or [os.path.dirname(__file__)])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
