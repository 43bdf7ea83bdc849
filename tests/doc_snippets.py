"""The fenced code blocks of README.md and docs/*.md, and how to run them.

A ```python block runs by default, with the page's earlier blocks, in
order, in one namespace, in a fresh process (tests/docs_runner.py): a
page reads as one session. An HTML comment on the line before the fence
changes that:

- `<!-- test: skip: REASON -->`: not run; REASON says why, in the page.
- `<!-- test: script -->`: a whole script, run in a process of its own
  (the page's other blocks do not see it).
- `<!-- test: script workers=N -->`: a whole script, run by
  `python -m tf_agn.strategies.launch --multi_worker N` as every worker of
  a localhost cluster.

Imports no TensorFlow: the tests and the runner both use it.
"""

import dataclasses
import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    """One fenced code block of a page."""

    page: str  # relative to the repository root
    line: int  # 1-based line of the first code line
    language: str
    code: str  # dedented
    directive: str  # "" or the text after "test:"

    @property
    def skip_reason(self):
        """The reason of a `skip:` directive, or None if it runs."""
        if self.directive.startswith("skip"):
            return self.directive[len("skip"):].lstrip(":").strip()
        return None

    @property
    def is_script(self):
        """Whether the block is a whole script, run on its own."""
        return re.fullmatch(r"script(\s+workers=\d+)?", self.directive) is not None

    @property
    def workers(self):
        """N of a `script workers=N` directive, or None."""
        match = re.fullmatch(r"script\s+workers=(\d+)", self.directive)
        return int(match.group(1)) if match else None

    @property
    def runs_in_session(self):
        """Whether the block runs with the page's other blocks."""
        return self.language == "python" and not self.directive


def pages():
    """README.md, then every docs/*.md, relative to the repository root."""
    docs = sorted(
        os.path.join("docs", name)
        for name in os.listdir(os.path.join(ROOT, "docs"))
        if name.endswith(".md")
    )
    return ["README.md", *docs]


def blocks(page):
    """Every fenced block of `page`, in order."""
    lines = open(os.path.join(ROOT, page), encoding="utf-8").read().splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, language = opening.groups()
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        previous = next(
            (lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), ""
        )
        directive = _DIRECTIVE.match(previous)
        found.append(
            Block(
                page=page,
                line=index + 2,
                language=language,
                code=textwrap.dedent("\n".join(lines[index + 1:end])) + "\n",
                directive=directive.group(1) if directive else "",
            )
        )
        index = end + 1
    return found


def compiled(block):
    """`block`'s code compiled so that tracebacks name the page's lines."""
    padded = "\n" * (block.line - 1) + block.code
    return compile(padded, os.path.join(ROOT, block.page), "exec")
