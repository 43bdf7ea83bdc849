"""The README's and the guides' (docs/*.md) Python snippets run, and their
links lead somewhere.

Each page's ```python blocks run in order in one fresh process, as a
reader would paste them into one session (tests/docs_runner.py); a block
marked `<!-- test: script workers=N -->` runs as every worker of a
localhost cluster, and one marked `<!-- test: skip: REASON -->` does not
run (tests/doc_snippets.py).
"""

import os
import re
import subprocess
import sys

import pytest

import doc_snippets
from scripts import checkout_env

ROOT = doc_snippets.ROOT
RUNNER = os.path.join(ROOT, "tests", "docs_runner.py")
PAGES = doc_snippets.pages()
GUIDES = [page for page in PAGES if page.startswith("docs")]
# Pages whose links are followed: the snippets' pages and the benchmarks'.
LINKED = PAGES + ["benchmarks/README.md"]


def _run(command, cwd, timeout):
    result = subprocess.run(
        command, cwd=cwd, env=checkout_env(), capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    return result.stdout


def _session_pages():
    return [
        page for page in PAGES
        if any(block.runs_in_session for block in doc_snippets.blocks(page))
    ]


def _scripts():
    return [
        pytest.param(block, id=f"{block.page}:{block.line}")
        for page in PAGES
        for block in doc_snippets.blocks(page)
        if block.is_script
    ]


@pytest.mark.parametrize("page", _session_pages())
def test_page_snippets_run_in_order(page, tmp_path):
    stdout = _run([sys.executable, RUNNER, page], tmp_path, timeout=600)
    expected = [
        f"ran {page}:{block.line}"
        for block in doc_snippets.blocks(page)
        if block.runs_in_session
    ]
    assert re.findall(rf"^ran {re.escape(page)}:\d+$", stdout, re.MULTILINE) == expected


@pytest.mark.parametrize("block", _scripts())
def test_script_snippet_runs(block, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(block.code, encoding="utf-8")
    command = [sys.executable, str(script)]
    if block.workers:
        command = [
            sys.executable, "-m", "tf_agn.strategies.launch",
            "--multi_worker", str(block.workers), "--", *command,
        ]
    _run(command, tmp_path, timeout=600)


def test_every_python_block_runs_or_says_why_not():
    for page in PAGES:
        for block in doc_snippets.blocks(page):
            where = f"{page}:{block.line}"
            if block.language != "python":
                assert not block.directive, f"{where}: a test directive on a {block.language!r} block"
                continue
            if block.skip_reason is not None:
                assert block.skip_reason, f"{where}: say why the snippet is skipped"
                continue
            assert block.runs_in_session or block.is_script, (
                f"{where}: unknown directive {block.directive!r}"
            )


def test_every_guide_has_a_snippet_that_runs():
    for page in GUIDES:
        runnable = [
            block for block in doc_snippets.blocks(page)
            if block.runs_in_session or block.is_script
        ]
        assert runnable, f"{page} has no Python snippet that runs"


def test_the_readme_links_every_guide():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    for page in GUIDES:
        assert f"({page}" in readme, f"README.md does not link {page}"


def _anchors(path):
    """GitHub's anchors of the headings of the Markdown file `path`."""
    anchors, in_code = set(), False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_lead_to_files_and_headings():
    broken = []
    for page in LINKED:
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(
                os.path.join(ROOT, os.path.dirname(page), path) if path
                else os.path.join(ROOT, page)
            )
            if not os.path.exists(resolved):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
