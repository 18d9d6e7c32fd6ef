"""Accelerator device binding: set this rank's device before the engine exists, and on every executor
thread (device selection is per thread in CUDA and CANN)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from .config import TransferConfig

__all__ = ["bind_device", "device_initializer"]

log = logging.getLogger("aiotransfer.device")


def _backends() -> list[Any]:
    """torch.cuda and torch.npu when present and usable (torch is never required)."""
    out: list[Any] = []
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return out
    for name in ("cuda", "npu"):
        mod = getattr(torch, name, None)
        if mod is not None and getattr(mod, "is_available", lambda: False)():
            out.append(mod)
    return out


def bind_device(device_id: int | None, backends: list[Any] | None = None) -> str | None:
    """Set ``device_id`` as the current device on this thread; returns which backend did it."""
    if device_id is None:
        return None
    for mod in _backends() if backends is None else backends:
        mod.set_device(device_id)
        return str(getattr(mod, "__name__", "device"))
    return None


def device_initializer(config: TransferConfig, backends: list[Any] | None = None) -> Callable[[], None] | None:
    """An executor-thread initializer binding ``config.device_id`` (None when there is nothing to bind)."""
    if config.device_id is None:
        return None
    device_id = config.device_id

    def init() -> None:
        bind_device(device_id, backends)

    return init
