"""aiotransfer: asyncio-native KV-cache transfer for prefill/decode disaggregation.

The public surface is re-exported here; everything in underscore modules is internal.
"""

from __future__ import annotations

from ._deadline import DEFAULT as DEFAULT
from ._deadline import Default as Default
from ._lag import LoopLagMonitor as LoopLagMonitor
from .args import Buffer as Buffer
from .args import KVArgs as KVArgs
from .aux_state import MemPool as MemPool
from .aux_state import StateType as StateType
from .aux_state import alloc_metadata_buffer as alloc_metadata_buffer
from .config import AuxPath as AuxPath
from .config import TransferConfig as TransferConfig
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
from .events import PeerEvent as PeerEvent
from .manager import KVManager as KVManager
from .metrics import PrometheusExporter as PrometheusExporter
from .receiver import KVReceiver as KVReceiver
from .sender import KVSender as KVSender
from .status import KVPoll as KVPoll
from .stream import KVStream as KVStream

__version__ = "0.8.0"

__all__ = [
    # core
    "KVArgs",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVStream",
    "Buffer",
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
