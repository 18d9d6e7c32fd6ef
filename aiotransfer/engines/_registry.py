"""Engine registry: name -> "module:factory", imported lazily (unused engines are never imported)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .._config import TransferConfig
    from ._base import TransferEngine

__all__ = ["available_engines", "create_engine", "register_engine"]

_ENGINES: dict[str, str] = {
    "mooncake": "aiotransfer.engines._mooncake:MooncakeEngine",
    "mooncake_tcp": "aiotransfer.engines._mooncake:MooncakeEngine",
    "nixl": "aiotransfer.engines._nixl:NixlEngine",
    "mori": "aiotransfer.engines._mori:MoriEngine",
    "memory": "aiotransfer.testing._engine:engine_from_config",
}
"""Engines that ship with aiotransfer. ``memory`` is for tests (:mod:`aiotransfer.testing`): it copies between
host buffers of one process and never reaches another."""


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
    _check_contract(config.engine, engine)
    return engine


_OPTIONAL_MEMBERS = ("traits", "probe_region", "credit_scope", "try_submit_inline", "try_extend_inline", "reach",
                     "abandon")
"""Protocol members with defaults in ``EngineBase``: an adapter written before they existed lacks them."""


def _check_contract(name: str, engine: Any) -> None:
    """Refuse, with the fix, an engine that lacks members the core reads (it would fail mid-transfer)."""
    missing = [m for m in _OPTIONAL_MEMBERS if not hasattr(engine, m)]
    if not missing:
        return
    with contextlib.suppress(Exception):
        engine.close()
    raise ConfigError(
        f"engine {name!r} ({type(engine).__qualname__}) lacks {', '.join(missing)}: inherit "
        "aiotransfer.engines.EngineBase for their defaults, or declare them (docs: Writing an engine)"
    )
