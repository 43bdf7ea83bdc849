"""Packaging: `strategies/` installs as `tf_agn.strategies`, never as a
top-level module, and the README's commands are the ones CI runs."""

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plain_install_maps_strategies_into_the_package(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "-q", "--target", str(target), ROOT],
        check=True,
        cwd=tmp_path,
    )
    assert (target / "tf_agn" / "strategies" / "mirrored.py").is_file()
    assert not (target / "strategies").exists()
    for init in glob.glob(os.path.join(ROOT, "tf_agn", "**", "__init__.py"), recursive=True):
        assert (target / os.path.relpath(init, ROOT)).is_file(), init
    probe = (
        "import tf_agn.strategies as s, tf_agn.optimizers as o;"
        "print(s.__file__); print(o.__file__)"
    )
    env = dict(os.environ, PYTHONPATH=str(target), TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env,
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert all(path.startswith(str(target)) for path in out), out


def test_source_checkout_attaches_strategies():
    import tf_agn
    import tf_agn.strategies

    assert tf_agn.strategies.__file__ == os.path.join(ROOT, "strategies", "__init__.py")
    assert tf_agn.strategies.mirrored.__module__ == "tf_agn.strategies.mirrored"


def test_readme_commands_are_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    commands = re.findall(r"^pip install .*$", readme, flags=re.MULTILINE)
    assert len(commands) == 2, commands
    test_command = next(c for c in commands if "pytest" in c)
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert test_command in ci


def _tracked_files():
    return subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout.split("\0")[:-1]


# The product's fixed top level; dotfiles (.ci/, .gitignore, ...) are free.
TOP_LEVEL = {
    "setup.py", "README.md", "BUILD", "tf_agn", "strategies", "tests",
    "examples", "benchmarks", "docs",
}
MAX_TRACKED_BYTES = 1 << 20
# Committed result images are the one kind of file allowed past the limit.
LARGE_FILE_SUFFIXES = (".png",)


def test_top_level_holds_only_the_product_layout():
    top = {path.split("/")[0] for path in _tracked_files()}
    stray = sorted(name for name in top - TOP_LEVEL if not name.startswith("."))
    assert not stray, (
        f"tracked entries outside the top-level layout {sorted(TOP_LEVEL)}: "
        f"{stray}. Downloaded packages and generated files belong in a "
        "temporary folder, not in the repository."
    )


def test_no_tracked_file_is_over_one_megabyte():
    large = sorted(
        path for path in _tracked_files()
        if not path.endswith(LARGE_FILE_SUFFIXES)
        and os.path.getsize(os.path.join(ROOT, path)) > MAX_TRACKED_BYTES
    )
    assert not large, (
        f"tracked files over {MAX_TRACKED_BYTES} bytes: {large}; only result "
        f"images ({LARGE_FILE_SUFFIXES}) may be larger"
    )


def test_importing_without_tensorflow_says_how_to_install_it():
    from tf_agn import _compat

    oldest = _compat.TESTED_VERSIONS["oldest"]["tensorflow"]
    probe = "import sys; sys.modules['tensorflow'] = None; import tf_agn"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 1
    assert f"ImportError: tf_agn needs TensorFlow {oldest} or newer, which is not" in result.stderr
    assert "pip install 'tf_agn[tensorflow]'" in result.stderr
