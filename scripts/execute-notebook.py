#!/usr/bin/env python3
"""Run a notebook of examples/ top to bottom and save it with its outputs (the docs show them).

Usage: ``PYTHONPATH=. .venv/bin/python scripts/execute-notebook.py examples/explore_transfer.ipynb``

It records a digest of the code cells in the notebook's metadata. tests/test_examples.py checks that the
committed outputs come from one run of the committed code (the digest matches, cells numbered 1..N in
order, no error), that a cell showing ``aiotransfer.__version__`` shows the installed one, and that executing
the notebook again makes each cell show the same text (addresses masked, and numbers too in a cell tagged
``measured``) and the same kinds of figure. Re-run it whenever the version or an output changes.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import nbclient
import nbformat


def code_digest(nb: nbformat.NotebookNode) -> str:
    """SHA-256 of the notebook's code cells, in order: which code the saved outputs come from."""
    sources = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    return hashlib.sha256("\0".join(sources).encode()).hexdigest()


def execute(path: Path) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=60, record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    for cell in nb.cells:  # the engines' logging on stderr is no part of the example
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
    nb.metadata.pop("widgets", None)
    nb.metadata["executed_code_sha256"] = code_digest(nb)
    nbformat.write(nb, path)


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["examples/explore_transfer.ipynb"]:
        execute(Path(arg))
        print(f"executed {arg}")
