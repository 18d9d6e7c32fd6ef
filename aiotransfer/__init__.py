"""aiotransfer: asyncio-native KV-cache transfer for prefill/decode disaggregation.

The public surface is re-exported here; everything in underscore modules is internal.
"""

from __future__ import annotations

from ._args import Buffer as Buffer
from ._args import KVArgs as KVArgs
from ._aux_state import MemPool as MemPool
from ._aux_state import StateType as StateType
from ._aux_state import alloc_metadata_buffer as alloc_metadata_buffer
from ._config import AuxPath as AuxPath
from ._config import TransferConfig as TransferConfig
from ._deadline import DEFAULT as DEFAULT
from ._deadline import Default as Default
from ._events import PeerEvent as PeerEvent
from ._lag import LoopLagMonitor as LoopLagMonitor
from ._manager import KVManager as KVManager
from ._metrics import PrometheusExporter as PrometheusExporter
from ._receiver import KVReceiver as KVReceiver
from ._sender import KVSender as KVSender
from ._status import KVPoll as KVPoll
from ._stream import KVStream as KVStream
from ._types import DeviceWork as DeviceWork
from ._types import LatencySummary as LatencySummary
from ._types import ManagerStats as ManagerStats
from ._types import PageIndices as PageIndices
from ._types import SupportsArray as SupportsArray
from .errors import AiotransferError as AiotransferError
from .errors import ClosedError as ClosedError
from .errors import ConfigError as ConfigError
from .errors import EngineError as EngineError
from .errors import EngineUnavailable as EngineUnavailable
from .errors import IncompatiblePeer as IncompatiblePeer
from .errors import InvalidArgument as InvalidArgument
from .errors import PeerError as PeerError
from .errors import ProtocolError as ProtocolError
from .errors import TransferFailed as TransferFailed
from .errors import TransferTimeout as TransferTimeout

__version__ = "0.13.0"

__all__ = [
    # core
    "KVArgs",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVStream",
    "Buffer",
    # argument and result types
    "PageIndices",
    "SupportsArray",
    "DeviceWork",
    "ManagerStats",
    "LatencySummary",
    # aux and state
    "StateType",
    "MemPool",
    "alloc_metadata_buffer",
    # observability
    "LoopLagMonitor",
    "PeerEvent",
    "PrometheusExporter",
    # configuration
    "AuxPath",
    "DEFAULT",
    "Default",
    "TransferConfig",
    # errors
    "AiotransferError",
    "ClosedError",
    "ConfigError",
    "EngineError",
    "EngineUnavailable",
    "IncompatiblePeer",
    "InvalidArgument",
    "PeerError",
    "ProtocolError",
    "TransferFailed",
    "TransferTimeout",
]


def _own_exports() -> None:
    """Every class and function exported here names ``aiotransfer`` as its module, where users import it
    from: reprs, tracebacks and pickles show ``aiotransfer.TransferFailed``, not the private module it lives
    in (which may move in any release)."""
    for name in __all__:
        obj = globals()[name]
        if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__code__")):
            obj.__module__ = __name__


_own_exports()

