"""Runs a page's ```python blocks in order, in one namespace, as a reader
would paste them into one session:

    python tests/docs_runner.py docs/aggregation.md

Run from the directory the snippets may write to (tests/test_docs.py
gives each page a temporary one). Prints `ran PAGE:LINE` after each block;
a failing block's traceback names the page's own lines.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import doc_snippets  # noqa: E402


def main(page):
    namespace = {"__name__": "__main__"}
    for block in doc_snippets.blocks(page):
        if not block.runs_in_session:
            continue
        exec(doc_snippets.compiled(block), namespace)  # noqa: S102
        print(f"ran {page}:{block.line}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
