"""SGLang 0.5.x wire profile (``TransferConfig(wire="sglang-mooncake")``).

A control plane with the same interface as :class:`~aiotransfer._control.endpoint.ControlPlane` that speaks
SGLang's Mooncake-backend protocol instead of ours (the frame-by-frame contract is ``docs/sglang-wire.md``).
It translates at the boundary, so the manager, senders and receivers stay protocol-agnostic:

=====================================  =============================================================
ours (internal message)                SGLang on the wire
=====================================  =============================================================
``TopologyQuery`` -> ``Topology``      ``GET /route`` (all ``-1``, then each rank) on the bootstrap HTTP
``Hello`` (decode -> prefill)          register message (``None`` frame + 19 frames); no reply, so a
                                       ``HelloAck`` is synthesised locally
``TransferRequest``                    transfer metadata (10 frames; dummy = empty pages and aux slot)
``Status``                             ``[room, status, prefill_unique_rank]``
``AuxData``                            ``AUX_DATA`` frames, on the same socket before the status
``Abort``                              ``ABORT`` (decode -> prefill); prefill answers ``ABORT_ACK``
``RankRegister``                       ``PUT /route`` to the bootstrap HTTP server
``Ping`` -> ``Pong``                   prefill side: ``GET /health`` of the bootstrap server; decode side:
                                       SGLang decodes have no health probe, liveness comes from the
                                       engine and timeouts
=====================================  =============================================================

The prefill leader of an aiotransfer deployment serves the bootstrap HTTP API (aiohttp) itself. SGLang's
receive loops die on frames they cannot parse, so everything sent here is built to the contract, and
everything received is parsed leniently by length and validated; a bad frame is counted and dropped.
Needs ``aiohttp`` (``pip install 'aiotransfer[sglang]'``).

The package: ``_frames`` (the codec: frames <-> internal messages, pure), ``_bootstrap`` (the HTTP
bootstrap server and client, aiohttp), ``_plane`` (:class:`SglangControlPlane`, which ties them to the
ZMQ endpoint).
"""

from __future__ import annotations

from ._frames import SGLANG_VERSION as SGLANG_VERSION
from ._frames import SglangIdentity as SglangIdentity
from ._frames import pack_int_lists as pack_int_lists
from ._frames import unpack_int_lists as unpack_int_lists
from ._plane import SglangControlPlane as SglangControlPlane

__all__ = ["SGLANG_VERSION", "SglangControlPlane", "SglangIdentity", "pack_int_lists", "unpack_int_lists"]
