"""BUILD has a target for every test file and example, and each is wired right.

BUILD is read by running it as Python with stand-ins for Bazel's rules,
so this needs no Bazel. Under `bazel test //:test_build_targets` it reads the
runfiles, whose `data` globs hold the current test files and examples.
A failure says what to add to BUILD.
"""

import os
import pathlib

ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
MAIN = "tests/pytest_main.py"


def _files(*patterns, exclude=()):
    def match(pats):
        found = set()
        for pat in pats:
            if pat.endswith("**"):  # Bazel's "dir/**" means every file below
                pat += "/*"
            found.update(
                p.relative_to(ROOT).as_posix()
                for p in ROOT.glob(pat)
                if p.is_file()
            )
        return found

    return sorted(match(patterns) - match(exclude))


def _rules(kind):
    """Runs BUILD as Python with stand-ins for Bazel's functions."""
    rules = []

    def recorder(rule_kind):
        return lambda *args, **attrs: rules.append(
            dict(attrs, kind=rule_kind, args_=args)
        )

    namespace = {
        name: recorder(name)
        for name in ("package", "py_library", "py_test", "py_binary")
    }
    namespace["glob"] = lambda include, exclude=(), **_: _files(
        *include, exclude=exclude
    )
    text = (ROOT / "BUILD").read_text(encoding="utf-8")
    exec(compile(text, str(ROOT / "BUILD"), "exec"), namespace)
    return [r for r in rules if r["kind"] == kind]


def test_every_test_file_has_a_py_test():
    covered = {src for rule in _rules("py_test") for src in rule["srcs"]}
    missing = [p for p in _files("tests/test_*.py") if p not in covered]
    names = [pathlib.PurePosixPath(p).stem for p in missing]
    assert not missing, f"Add to BUILD's list of py_test names: {names}"


def test_every_example_has_a_py_binary():
    covered = {src for rule in _rules("py_binary") for src in rule["srcs"]}
    missing = [p for p in _files("examples/*.py") if p not in covered]
    names = [pathlib.PurePosixPath(p).stem for p in missing]
    assert not missing, f"Add to BUILD's list of py_binary names: {names}"


def test_each_py_test_runs_its_own_file_under_pytest():
    tests = _rules("py_test")
    assert tests
    for rule in tests:
        (own,) = [s for s in rule["srcs"] if s != MAIN]
        assert rule["main"] == MAIN and MAIN in rule["srcs"], rule["name"]
        assert rule["python_version"] == "PY3", rule["name"]
        assert rule["args"] == [f"$(location {own})"], rule["name"]
        assert rule["name"] == pathlib.PurePosixPath(own).stem
        assert own.startswith("tests/test_") and own.endswith(".py")
        assert ":test_support" in rule["deps"], rule["name"]


def test_each_py_binary_runs_its_example():
    for rule in _rules("py_binary"):
        assert rule["srcs"] == [rule["main"]], rule["name"]
        assert rule["name"] == pathlib.PurePosixPath(rule["main"]).stem
        assert rule["python_version"] == "PY3", rule["name"]
        assert ":tf_agn" in rule["deps"], rule["name"]


def test_targets_name_files_that_exist():
    for kind in ("py_test", "py_binary"):
        for rule in _rules(kind):
            for src in rule["srcs"]:
                assert (ROOT / src).is_file(), f'{rule["name"]}: no {src}'


def test_library_holds_the_package_and_its_strategies():
    (lib,) = [r for r in _rules("py_library") if r["name"] == "tf_agn"]
    assert lib["imports"] == ["."]
    assert {"tf_agn/__init__.py", "strategies/__init__.py"} <= set(lib["srcs"])
