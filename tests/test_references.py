"""Every dotted name the prose cites exists.

The prose is the docstrings (and `X.__doc__ = ...` strings) and comments
of tf_agn/ and strategies/, and README.md and docs/*.md outside their
fenced code blocks (tests/test_docs.py runs those). A citation is a
backticked span that is a dotted name, optionally called:
`tf_agn.optimizers.AGN`, `Compressor.combine`, `model.fit(...)`.

Its first part decides how it resolves; the rest are attributes, each of
which must exist on what the part before it denotes (a class's instance
attribute counts when some class in its MRO assigns `self.<name>`, as the
last part only). The first part may denote, and the name resolves if any
of these has the rest:
- an importable top-level module (`tf_agn`, `keras`, `absl`, ...), or
  `tf` and `np` as imported by convention;
- a module or package of tf_agn or strategies, by its own name
  (`routing`), or a class defined in one, by its name (`Aggregating`);
- a name from outside tf_agn that the prose cites short, in `SHORT_NAMES`
  (`BaseOptimizer`, TF's `distribute_utils`);
- a value of a type in `INSTANCES` (`model`, `optimizer`, `strategy`).
Two kinds of span are skipped: file names (last part a suffix in
`FILE_SUFFIXES`: `setup.py`, `latest.weights.h5`), and spans whose first
part is lowercase and none of the above (a local value: `state.packs`).
A capitalized first part that is none of the above is unresolved.
"""

import ast
import functools
import importlib
import importlib.util
import inspect
import io
import os
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?")

FILE_SUFFIXES = {"h5", "json", "keras", "md", "npz", "py", "sh", "txt", "xz"}

CONVENTIONAL = {"tf": "tensorflow", "np": "numpy"}

SHORT_NAMES = {
    "BaseOptimizer": "keras.src.optimizers.base_optimizer.BaseOptimizer",
    "CollectiveAllReduceExtended": "tensorflow.python.distribute."
    "collective_all_reduce_strategy.CollectiveAllReduceExtended",
    "Function": "keras.src.ops.function.Function",
    "LossScaleOptimizer": "keras.optimizers.LossScaleOptimizer",
    "Popen": "subprocess.Popen",
    "TFOptimizer": "keras.src.backend.tensorflow.optimizer.TFOptimizer",
    "Trainer": "keras.src.trainers.trainer.Trainer",
    "cross_device_ops": "tensorflow.python.distribute.cross_device_ops",
    "distribute_utils": "tensorflow.python.distribute.distribute_utils",
    "ps_values": "tensorflow.python.distribute.ps_values",
    "resource_variable_ops": "tensorflow.python.ops.resource_variable_ops",
    "values": "tensorflow.python.distribute.values",
}


# A value's name -> the types it may have; a module stands for every class
# it defines or imports.
INSTANCES = {
    "compressor": ["tf_agn.compression"],
    "input_context": ["tensorflow.distribute.InputContext"],
    "model": ["keras.Model", "tf_agn.decoupled"],
    "optimizer": ["keras.optimizers.Optimizer", "tf_agn.optimizers"],
    "replica_context": ["tensorflow.distribute.ReplicaContext"],
    "strategy": ["tensorflow.distribute.Strategy"],
    "variable": ["keras.Variable", "tensorflow.Variable"],
}


def source_files():
    # tf_agn/strategies is strategies/ under another name, in a checkout.
    return sorted(
        path for path in [*(ROOT / "tf_agn").rglob("*.py"),
                          *(ROOT / "strategies").rglob("*.py")]
        if path.relative_to(ROOT).parts[:2] != ("tf_agn", "strategies"))


def guide_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "strategies":
        parts.insert(0, "tf_agn")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_prose(path):
    """(line, text) of each docstring line and comment of a source file."""
    source = path.read_text()
    strings = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)) and node.body:
            strings.append(node.body[0].value if isinstance(
                node.body[0], ast.Expr) else None)
        elif isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Attribute) and target.attr == "__doc__"
                for target in node.targets):
            strings.append(node.value)
    for string in strings:
        if isinstance(string, ast.Constant) and isinstance(string.value, str):
            yield from ((string.lineno + offset, line) for offset, line
                        in enumerate(string.value.splitlines()))
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    yield from ((token.start[0], token.string) for token in tokens
                if token.type == tokenize.COMMENT)


def markdown_prose(path):
    """(line, text) of each line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def citations(paths=None):
    """{dotted name: [where it is cited]} in `paths`, by default the prose's
    files."""
    cited = {}
    for path in paths or source_files() + guide_files():
        prose = markdown_prose if path.suffix == ".md" else python_prose
        for line, text in prose(path):
            for span in SPAN.findall(text):
                match = DOTTED.fullmatch(span.strip())
                if match:
                    cited.setdefault(match.group(1), []).append(
                        f"{os.path.relpath(path, ROOT)}:{line}")
    return cited


def load(dotted):
    """The object a fully qualified name denotes, or None."""
    first, *rest = dotted.split(".")
    try:
        obj = importlib.import_module(first)
        for position, part in enumerate(rest, 2):
            obj = getattr(obj, part) if hasattr(obj, part) else (
                importlib.import_module(".".join([first, *rest][:position])))
    except ImportError:
        return None
    return obj


@functools.cache
def project_index():
    """{short name: [fully qualified name]} of tf_agn's and strategies'
    modules and module-level classes."""
    index = {}
    for path in source_files():
        if path.stem == "__main__":
            continue
        module = module_name(path)
        index.setdefault(module.rsplit(".", 1)[-1], []).append(module)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                index.setdefault(node.name, []).append(f"{module}.{node.name}")
    return index


def classes_of(dotted):
    obj = load(dotted)
    if inspect.ismodule(obj):
        return [value for value in vars(obj).values() if inspect.isclass(value)]
    return [obj]


def denotations(first):
    """The objects a citation's first part may denote."""
    if first in INSTANCES:
        return [cls for dotted in INSTANCES[first] for cls in classes_of(dotted)]
    names = project_index().get(first, []) + (
        [SHORT_NAMES[first]] if first in SHORT_NAMES else [])
    if first in CONVENTIONAL or importlib.util.find_spec(first) is not None:
        names.append(CONVENTIONAL.get(first, first))
    return [obj for obj in map(load, names) if obj is not None]


def instance_attributes(cls):
    """The names some class of `cls`'s MRO assigns as `self.<name>` or
    annotates in its body."""
    names = set()
    for klass in inspect.getmro(cls):
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())
        except (OSError, TypeError):
            continue
        names.update(
            node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self")
        names.update(node.target.id for node in tree.body[0].body
                     if isinstance(node, ast.AnnAssign)
                     and isinstance(node.target, ast.Name))
    return names


def has_path(obj, attributes):
    for position, attribute in enumerate(attributes):
        if inspect.ismodule(obj) and not hasattr(obj, attribute):
            # A submodule no test imported yet: whether it resolves must
            # not depend on the order tests run in.
            try:
                importlib.import_module(f"{obj.__name__}.{attribute}")
            except ImportError:
                pass
        if hasattr(obj, attribute):
            obj = getattr(obj, attribute)
        else:
            return (position == len(attributes) - 1 and inspect.isclass(obj)
                    and attribute in instance_attributes(obj))
    return True


def skipped(dotted):
    first, *_, last = dotted.split(".")
    return last in FILE_SUFFIXES or (first[0].islower() and not denotations(first))


def resolves(dotted):
    first, *rest = dotted.split(".")
    return any(has_path(obj, rest) for obj in denotations(first))


def test_every_cited_name_exists():
    cited = citations()
    checked = [name for name in cited if not skipped(name)]
    unresolved = [f"`{name}` cited at {', '.join(cited[name])}"
                  for name in sorted(checked) if not resolves(name)]
    assert not unresolved, "cited names that do not exist:\n" + "\n".join(
        unresolved)


def test_citations_are_collected_from_prose_only(tmp_path):
    source = tmp_path / "module.py"
    source.write_text('''"""Cites `a.b` and `c.d(x)`, not `e` or `f.py`."""

# Cites `g.h`.
def f():
    """Cites `i.j`."""
    return "`k.l`"


f.__doc__ = "Cites `m.n`."
''')
    guide = tmp_path / "guide.md"
    guide.write_text("Cites `o.p`.\n```python\nx = `q.r`\n```\n`s.t`\n")
    cited = citations([source, guide])
    assert sorted(cited) == [
        "a.b", "c.d", "f.py", "g.h", "i.j", "m.n", "o.p", "s.t"]
    assert cited["g.h"] == [f"{os.path.relpath(source, ROOT)}:3"]
    assert cited["s.t"] == [f"{os.path.relpath(guide, ROOT)}:5"]


@pytest.mark.parametrize("name", [
    "tf_agn.optimizers.AGN",
    "tf.distribute.MirroredStrategy.run",
    "optimizers.AGN",  # a package of tf_agn by its own name
    "AGN.get_config",  # a class of tf_agn by its name
    "BaseOptimizer._learning_rate",  # set in __init__
    "strategy.reduce",
    "optimizer.communication_stats",  # tf_agn's optimizers only
])
def test_existing_names_resolve(name):
    assert not skipped(name) and resolves(name)


@pytest.mark.parametrize("name", [
    "tf_agn.optimizers.NoSuchOptimizer",
    "AggregatingAllReduce.aggregate",
    "Aggregating.saved_values",
    "NoSuchClass.apply",
    "optimizers.NoSuchOptimizer",
    "model.no_such_method",
    "BaseOptimizer._learning_rate.numpy",  # an instance attribute ends a path
])
def test_missing_names_do_not(name):
    assert not skipped(name) and not resolves(name)


@pytest.mark.parametrize("name", ["setup.py", "latest.weights.h5", "state.packs"])
def test_skipped(name):
    assert skipped(name)
