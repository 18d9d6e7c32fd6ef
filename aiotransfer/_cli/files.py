"""Small file helpers the tools share."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["write_json"]


def write_json(path: str, data: Any, *, indent: int = 1) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a temporary file, then a rename), making its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=indent, default=str)
        f.write("\n")
    os.replace(path + ".tmp", path)
