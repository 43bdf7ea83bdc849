"""The README's API table is the code's: every signature in it is the
callable's own, and every argument it names is in the docstring's Args.

Each row of the table under "## API" is `| names | arguments | what |`.
The names are backticked: the first a full dotted path, any others short
names beside it (`tf_agn.optimizers.DOWNPOUR`, `DynSGD`). The arguments
cell is "—" for a class or function without arguments (or a constant), or
one backticked Python parameter list, which must be the callable's
signature: every parameter, in order, of the same kind, with the same
default. A parameter that reaches a class through its `**kwargs` (AGN's
`compression`, a `WindowedOptimizer` argument) may be listed too, after
`*`: it must then be a parameter of a base class that receives those
`**kwargs`.

Where `**kwargs` go must be documented: to a base class of tf_agn's with
a row of its own (whose arguments are then checked there), or to a
class outside tf_agn (Keras's optimizer: its arguments are Keras's own
documentation's). A function's docstring names, in backticks, the
callable in the table that its `**kwargs` go to.

Every argument the row lists, `*args` and `**kwargs` included, must be in
the docstring's Args (the class's own docstring, or, for a class without
one, that of the class whose `__init__` it runs, or the one its "Args: as
`X`." names), and every entry of Args must be a parameter. Every public
name of the API's namespaces has a row.

Calls the README and the guides (docs/*.md) quote, `Name(keyword=...)`,
name only keywords the callable takes.
"""

import ast
import inspect
import os
import re
import signal
import types

from absl import flags
import keras
import pytest
import tensorflow as tf

import tf_agn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
NO_ARGUMENTS = "—"

# Public names of the API's namespaces that the table need not document,
# with the reason.
NOT_IN_TABLE = {
    "tf_agn.compression.serialize": "a helper of tf_agn's optimizers' configs",
    "tf_agn.compression.compresses": "a helper of tf_agn's optimizers",
    "tf_agn.compression.name_of": "a helper of tf_agn's optimizers' configs",
}
NAMESPACES = (
    "tf_agn",
    "tf_agn.optimizers",
    "tf_agn.compression",
    "tf_agn.strategies",
    "tf_agn.callbacks",
    "tf_agn.decoupled",
    "tf_agn.metrics",
    "tf_agn.models",
    "tf_agn.datasets",
)
# What the table's defaults may name besides literals.
DEFAULT_NAMES = {"flags": flags, "keras": keras, "signal": signal, "tf": tf}


def _table():
    """The API table's rows: (line, names, arguments cell)."""
    lines = open(README, encoding="utf-8").read().splitlines()
    start = lines.index("## API")
    rows, in_table = [], False
    for number, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if in_table:
                break
            continue
        in_table = True
        if re.fullmatch(r"\|[-|: ]+\|", line.strip()):
            continue  # the header's rule
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if cells[0] == "name":
            continue
        assert len(cells) == 3, f"README.md:{number}: expected 3 cells: {line}"
        names = re.findall(r"`([^`]+)`", cells[0])
        assert names, f"README.md:{number}: no name in {cells[0]!r}"
        parent = names[0].rpartition(".")[0]
        full = [names[0]] + [f"{parent}.{name}" for name in names[1:]]
        rows.append((number, full, cells[1]))
    assert rows, "README.md has no API table under '## API'"
    return rows


ROWS = _table()
DOCUMENTED = {name for _, names, _ in ROWS for name in names}


def _resolve(path):
    parts = path.split(".")
    assert parts[0] == "tf_agn", path
    obj = tf_agn
    for part in parts[1:]:
        assert hasattr(obj, part), f"{path}: {obj!r} has no {part!r}"
        obj = getattr(obj, part)
    return obj


def _is_ours(obj):
    return (getattr(obj, "__module__", None) or "").startswith("tf_agn")


def _parameters(function):
    """`function`'s parameters, without `self`."""
    parameters = list(inspect.signature(function).parameters.values())
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]
    return parameters


def _init_owner(cls, after=None):
    """The class of `cls`'s MRO (after `after`) that defines `__init__`."""
    mro = cls.__mro__
    start = mro.index(after) + 1 if after is not None else 0
    return next(klass for klass in mro[start:] if "__init__" in vars(klass))


def _own_parameters(obj):
    return _parameters(obj)  # a class's is its constructor's, without self


def _forwarded(cls):
    """The parameters `cls`'s `**kwargs` reach, and the classes they pass.

    Follows `__init__` up the MRO while each passes `**kwargs` on to a
    class of tf_agn's. Returns `({name: Parameter}, [classes])`: the
    nearest class's parameter wins.
    """
    found, bases = {}, []
    owner = _init_owner(cls)
    while any(p.kind is p.VAR_KEYWORD for p in _parameters(owner.__init__)):
        owner = _init_owner(cls, after=owner)
        if not _is_ours(owner):
            break
        bases.append(owner)
        for parameter in _parameters(owner.__init__):
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                found.setdefault(parameter.name, parameter)
    return found, bases


def _documented_parameters(cell, where):
    """The table's parameter list as `inspect.Parameter`s (defaults as code)."""
    if cell == NO_ARGUMENTS:
        return None
    match = re.fullmatch(r"`([^`]*)`", cell)
    assert match, f"{where}: the arguments cell must be {NO_ARGUMENTS!r} or one `...`"
    tree = ast.parse(f"def f({match.group(1)}): pass")
    args = tree.body[0].args
    result = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    for arg, default in zip(positional, defaults):
        result.append((arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default))
    if args.vararg:
        result.append((args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        result.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, default))
    if args.kwarg:
        result.append((args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None))
    return result


def _same_default(node, parameter):
    if node is None:
        return parameter.default is inspect.Parameter.empty
    if parameter.default is inspect.Parameter.empty:
        return False
    value = eval(compile(ast.Expression(node), "<README>", "eval"), dict(DEFAULT_NAMES))
    default = parameter.default
    return value is default or (type(value) is type(default) and value == default)


def _args_section(doc):
    """The names of a docstring's Args entries (without stars), or None if
    it has no Args; a string `X` for "Args: as `X`."."""
    if not doc:
        return None
    lines = inspect.cleandoc(doc).splitlines()
    for index, line in enumerate(lines):
        as_other = re.fullmatch(r"Args: as `([\w.]+)`\.?", line.strip())
        if as_other:
            return as_other.group(1)
        if line.strip() != "Args:":
            continue
        indent = len(line) - len(line.lstrip())
        names, entry_indent = set(), None
        for entry in lines[index + 1:]:
            if not entry.strip():
                continue
            depth = len(entry) - len(entry.lstrip())
            if depth <= indent:
                break
            if entry_indent is None:
                entry_indent = depth
            if depth == entry_indent:
                head = re.match(r"^\s*([*\w][\w*, ]*):", entry)
                if head:
                    names.update(n.strip().lstrip("*") for n in head.group(1).split(","))
        return names
    return None


def _docstring_args(obj):
    """(where, Args names) of the docstring that documents `obj`'s arguments."""
    if not inspect.isclass(obj):
        return obj.__qualname__, _args_section(obj.__doc__)
    seen = []
    while True:
        seen.append(obj.__name__)
        for doc in (vars(obj).get("__doc__"), vars(obj).get("__init__", None).__doc__
                    if "__init__" in vars(obj) else None):
            section = _args_section(doc)
            if isinstance(section, str):
                obj = getattr(inspect.getmodule(obj), section)
                break
            if section is not None:
                return obj.__qualname__, section
        else:
            owner = _init_owner(obj)
            if owner is obj or not _is_ours(owner):
                return obj.__qualname__, None
            obj = owner
        assert len(seen) < 10, f"docstring references loop: {seen}"


def _kwargs_target(function, var_keyword, documented_names):
    """The documented callable that `function`'s docstring says its
    `**var_keyword` go to (named in backticks in that Args entry), or None."""
    doc = inspect.cleandoc(function.__doc__ or "")
    entry = re.search(rf"\*\*{var_keyword}:(.*?)(?:\n\s*\n|\n    \w+:|\Z)", doc, re.S)
    for target in re.findall(r"`([\w.]+)`", entry.group(1)) if entry else []:
        for name in sorted(documented_names):
            if name == target or name.endswith("." + target):
                return name
    return None


def _problems(name, cell, documented_names=DOCUMENTED):
    """Every way the row of `name` differs from the code."""
    obj = _resolve(name)
    documented = _documented_parameters(cell, name)
    if documented is None:
        if callable(obj) and _is_ours(obj):
            extra = [p.name for p in _own_parameters(obj)]
            if extra:
                return [f"{name}: the table says no arguments; the code has {extra}"]
        return []
    problems = []
    own = _own_parameters(obj)
    own_names = [p.name for p in own]
    by_name = {p.name: p for p in own}
    forwarded, bases = _forwarded(obj) if inspect.isclass(obj) else ({}, [])
    table_names = [entry[0] for entry in documented]

    # The signature, in order, kind and default.
    listed_own = [n for n in table_names if n in by_name]
    if listed_own != own_names:
        problems.append(
            f"{name}: the table lists {listed_own}, the signature has {own_names}"
        )
    for entry_name, kind, default in documented:
        if entry_name in by_name:
            parameter = by_name[entry_name]
            if kind is not parameter.kind:
                problems.append(f"{name}: {entry_name} is {parameter.kind.description} in the code")
            elif not _same_default(default, parameter):
                problems.append(
                    f"{name}: {entry_name}'s default is "
                    f"{parameter.default!r} in the code, "
                    f"{ast.unparse(default) if default else 'none'} in the table"
                )
        elif entry_name in forwarded:
            if kind is not inspect.Parameter.KEYWORD_ONLY:
                problems.append(
                    f"{name}: {entry_name} reaches it through **kwargs: list it after `*`"
                )
            elif not _same_default(default, forwarded[entry_name]):
                problems.append(f"{name}: {entry_name}'s default differs from the code's")
        else:
            problems.append(f"{name}: {entry_name} is not an argument of the code")

    # Where **kwargs go: a class's to a base with a row of its own.
    var_keyword = [p.name for p in own if p.kind is p.VAR_KEYWORD]
    if var_keyword and bases:
        rows = {_resolve(d) for d in documented_names}
        if bases[0] not in rows:
            problems.append(
                f"{name}: its **{var_keyword[0]} go to {bases[0].__qualname__}, "
                "which has no row of its own"
            )

    # The docstring's Args.
    where, args = _docstring_args(obj)
    if args is None:
        problems.append(f"{name}: {where}'s docstring has no Args section")
        return problems
    for entry_name in table_names:
        if entry_name not in args:
            problems.append(f"{name}: {entry_name} is missing from {where}'s Args")
    parameter_names = set(own_names) | set(forwarded)
    for entry_name in sorted(args - parameter_names):
        problems.append(f"{name}: {where}'s Args documents {entry_name}, not an argument")
    if var_keyword and not inspect.isclass(obj):
        if _kwargs_target(obj, var_keyword[0], documented_names) is None:
            problems.append(
                f"{name}: the Args entry of **{var_keyword[0]} must name, in "
                "backticks, the documented callable they go to"
            )
    return problems


@pytest.mark.parametrize(
    "name, cell",
    [pytest.param(name, cell, id=name) for _, names, cell in ROWS for name in names],
)
def test_row_is_the_code(name, cell):
    problems = _problems(name, cell)
    assert not problems, "\n".join(problems)


def test_every_public_name_has_a_row():
    # A row of a method (`tf_agn.AggregationMethod.parse`) covers its class.
    covered = DOCUMENTED | {name.rpartition(".")[0] for name in DOCUMENTED}
    documented = {id(_resolve(name)) for name in covered if name.count(".")}
    missing = []
    for namespace in NAMESPACES:
        module = _resolve(namespace) if namespace != "tf_agn" else tf_agn
        for attribute, obj in vars(module).items():
            path = f"{namespace}.{attribute}"
            if attribute.startswith("_") or isinstance(obj, types.ModuleType):
                continue
            if not _is_ours(obj) or path in NOT_IN_TABLE or id(obj) in documented:
                continue
            missing.append(path)
    assert not missing, f"public API without a row in README.md's API table: {missing}"


def _accepted(obj, documented_names=DOCUMENTED):
    """The keyword arguments `obj` accepts: its own, those its **kwargs reach
    in tf_agn's bases, and, for a function, those of the documented callable
    its docstring sends **kwargs to. None if it takes any keyword."""
    own = _own_parameters(obj)
    names = {p.name for p in own if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    var_keyword = [p.name for p in own if p.kind is p.VAR_KEYWORD]
    if not var_keyword:
        return names
    if inspect.isclass(obj):
        # Up the MRO, Keras's classes included, while **kwargs go on.
        owner = _init_owner(obj)
        while any(p.kind is p.VAR_KEYWORD for p in _parameters(owner.__init__)):
            owner = _init_owner(obj, after=owner)
            if owner is object:
                break  # Keras's base optimizer refuses what it does not know
            names |= {p.name for p in _parameters(owner.__init__)
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        return names
    target = _kwargs_target(obj, var_keyword[0], documented_names)
    more = _accepted(_resolve(target), documented_names) if target else None
    return None if more is None else names | more


def _quoted_calls(page):
    """(line, callable path, keyword names) of each `Name(...)` a page
    quotes whose name is a documented callable's."""
    by_short = {}
    for name in DOCUMENTED:
        by_short.setdefault(name.rpartition(".")[2], set()).add(name)
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    for match in re.finditer(r"(?<![\w.])((?:tf_agn\.)?[\w.]+)\(([^`()]*(?:\([^`()]*\)[^`()]*)*)\)", text):
        name, inside = match.groups()
        paths = {name} & DOCUMENTED or by_short.get(name, set())
        if name.startswith(("keras.", "tf.")) or len(paths) != 1:
            continue
        try:
            call = ast.parse(f"f({inside})", mode="eval").body
        except SyntaxError:
            continue  # prose, not code
        keywords = [k.arg for k in call.keywords if k.arg]
        if keywords:
            line = text.count("\n", 0, match.start()) + 1
            yield line, paths.pop(), keywords


def test_guides_name_only_real_arguments():
    import doc_snippets

    problems = []
    for page in doc_snippets.pages():
        for line, path, keywords in _quoted_calls(page):
            accepted = _accepted(_resolve(path))
            if accepted is None:
                continue
            for keyword in keywords:
                if keyword not in accepted:
                    problems.append(f"{page}:{line}: {path} takes no {keyword!r}")
    assert not problems, "\n".join(problems)


# The checker itself: it must fail on drift, wherever it is.


def _sample(a, b=1, **kwargs):
    """A sample.

    Args:
        a: one.
        b: two.
        **kwargs: further `tf_agn.AggregatingAllReduce` arguments.
    """


def test_checker_fails_on_a_missing_or_undocumented_argument(monkeypatch):
    monkeypatch.setattr(tf_agn, "_sample", _sample, raising=False)
    monkeypatch.setattr(_sample, "__module__", "tf_agn.sample")
    assert _problems("tf_agn._sample", "`a, b=1, **kwargs`") == []
    assert _problems("tf_agn._sample", "`a, **kwargs`")  # b not in the table
    assert _problems("tf_agn._sample", "`a, b=2, **kwargs`")  # default
    assert _problems("tf_agn._sample", "`a, b=1, c=0, **kwargs`")  # not in the code
    monkeypatch.setattr(_sample, "__doc__", _sample.__doc__.replace("        b: two.\n", ""))
    assert any("missing from" in p for p in _problems("tf_agn._sample", "`a, b=1, **kwargs`"))


class _Base:
    """A base class.

    Args:
        a: one.
        extra: one more.
        **kwargs: Keras's.
    """

    def __init__(self, a, extra=None, **kwargs):
        pass


class _Child(_Base):
    """A class whose **kwargs reach `_Base`, which documents `extra`.

    Args:
        b: two.
        **kwargs: `_Base`'s.
    """

    def __init__(self, b=1, **kwargs):
        super().__init__(b, **kwargs)


def test_checker_follows_kwargs_to_a_documented_base(monkeypatch):
    for cls in (_Base, _Child):
        monkeypatch.setattr(tf_agn, cls.__name__, cls, raising=False)
        monkeypatch.setattr(cls, "__module__", "tf_agn.sample")
    both = {"tf_agn._Base", "tf_agn._Child"}
    assert _problems("tf_agn._Child", "`b=1, **kwargs`", both) == []
    # AGN's case: the table names a base's argument its docstring omits.
    assert _problems("tf_agn._Child", "`b=1, *, extra=None, **kwargs`", both) == [
        "tf_agn._Child: extra is missing from _Child's Args"
    ]
    assert any(
        "after `*`" in p for p in _problems("tf_agn._Child", "`b=1, extra=None, **kwargs`", both)
    )
    # The base has no row: where the **kwargs go is undocumented.
    assert any("no row" in p for p in _problems("tf_agn._Child", "`b=1, **kwargs`", {"tf_agn._Child"}))
