"""Transfer engines: the contract an adapter satisfies, the registry that selects one by name, and which
engine wheels fit a host.

Users pick an engine with ``TransferConfig(engine=...)`` and never import an adapter. This module is for
those who write one (docs: Writing an engine adapter). The adapters themselves (Mooncake, NIXL, MORI) live
in underscore modules and are imported lazily, on first use.
"""

from __future__ import annotations

from .._plan import Blocks as Blocks
from ._base import EngineBase as EngineBase
from ._base import EngineStatus as EngineStatus
from ._base import EngineTraits as EngineTraits
from ._base import MemoryRegion as MemoryRegion
from ._base import TransferEngine as TransferEngine
from ._base import TransferHandle as TransferHandle
from ._mooncake_setup import WheelChoice as WheelChoice
from ._mooncake_setup import recommended_wheels as recommended_wheels
from ._registry import available_engines as available_engines
from ._registry import create_engine as create_engine
from ._registry import register_engine as register_engine

__all__ = [
    # the contract
    "TransferEngine",
    "EngineBase",
    "EngineTraits",
    "EngineStatus",
    "TransferHandle",
    "MemoryRegion",
    "Blocks",
    # the registry
    "register_engine",
    "available_engines",
    "create_engine",
    # installation
    "recommended_wheels",
    "WheelChoice",
]
