"""Stand-in for IPython.display: the two names sglang.utils imports."""

from __future__ import annotations

from typing import Any


class HTML:
    def __init__(self, data: Any = None, *args: Any, **kwargs: Any) -> None:
        self.data = data

    def _repr_html_(self) -> Any:
        return self.data


def display(*objs: Any, **kwargs: Any) -> None:
    """No-op."""
