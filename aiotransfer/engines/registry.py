"""Engine registry: name -> "module:factory", imported lazily (unused engines are never imported)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import TransferConfig
    from .base import TransferEngine

__all__ = ["available_engines", "create_engine", "register_engine"]

_ENGINES: dict[str, str] = {
    "mooncake": "aiotransfer.engines.mooncake:MooncakeEngine",
    "mooncake_tcp": "aiotransfer.engines.mooncake:MooncakeEngine",
    "nixl": "aiotransfer.engines.nixl:NixlEngine",
    "mori": "aiotransfer.engines.mori:MoriEngine",
}


def register_engine(name: str, target: str | Callable[..., Any]) -> None:
    """Register an engine factory, as ``"package.module:Factory"`` or a callable ``(config) -> engine``."""
    if not name:
        raise ConfigError("engine name must be non-empty")
    _ENGINES[name] = target  # type: ignore[assignment]


def available_engines() -> list[str]:
    return sorted(_ENGINES)


def create_engine(config: TransferConfig) -> TransferEngine:
    """Instantiate ``config.engine`` (blocking: call through the offload executor)."""
    try:
        target: Any = _ENGINES[config.engine]
    except KeyError:
        raise ConfigError(
            f"unknown engine {config.engine!r}; known: {', '.join(available_engines())}"
        ) from None
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module_name), attr)
    engine: TransferEngine = target(config)
    return engine
