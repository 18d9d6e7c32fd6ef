"""The SGLang control plane: a :class:`~aiotransfer._control.endpoint.ControlPlane` speaking SGLang's frames.

It translates at the boundary (see the package docstring): outbound messages through the codec
(:mod:`._frames`) or the bootstrap HTTP client (:mod:`._bootstrap`), inbound frames through the codec,
with the per-peer state the frames leave implicit (which decode registered, which rank a room went to).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ...errors import EngineUnavailable, ProtocolError
from ..endpoint import ControlPlane
from ..messages import (
    PROTOCOL_VERSION,
    Abort,
    AuxData,
    Hello,
    HelloAck,
    Message,
    Ping,
    Pong,
    RankRegister,
    Status,
    TopologyQuery,
    TransferRequest,
)
from ._bootstrap import BootstrapClient, BootstrapServer, registration_body
from ._frames import (
    SglangIdentity,
    abort_frames,
    aux_frames,
    decode_abort,
    decode_aux,
    decode_metadata,
    decode_register,
    decode_status,
    hello_from_register,
    metadata_frames,
    register_frames,
    status_frames,
)

__all__ = ["SglangControlPlane"]

_MAX_TRACKED_ROOMS = 1 << 16
Handler = Callable[[Message], Awaitable[None] | None]


@dataclass
class _DecodeSession:
    """Prefill side: one SGLang decode rank that registered."""

    endpoint: str
    generation: int
    registrations: int = 1


class SglangControlPlane(ControlPlane):
    """See the package docstring. A ``ControlPlane`` whose frames are SGLang's (no HMAC: SGLang has none)."""

    def __init__(
        self,
        identity: SglangIdentity,
        port: int,
        handler: Handler,
        *,
        max_sockets: int,
        max_message_bytes: int,
    ) -> None:
        try:
            import aiohttp
        except ImportError as exc:
            raise EngineUnavailable(
                "the SGLang wire profile needs aiohttp: pip install 'aiotransfer[sglang]'"
            ) from exc
        super().__init__(identity.host, port, handler, max_sockets=max_sockets,
                         max_message_bytes=max_message_bytes)
        self.me = identity
        self._tasks: set[asyncio.Task[Any]] = set()
        # decode side
        self._bootstrap = BootstrapClient(aiohttp)
        """HTTP client of the prefills' bootstrap servers; knows each prefill rank's bootstrap and id"""
        self._room_targets: OrderedDict[int, dict[int, str]] = OrderedDict()
        """room -> {prefill_unique_rank: endpoint} of the ranks we sent real metadata to (SGLang's status
        and AUX_DATA frames name a rank or nothing, never an endpoint)"""
        # prefill side
        self._sessions: dict[str, _DecodeSession] = {}
        """decode endpoint -> registration"""
        self._by_session: dict[str, str] = {}
        """decode Mooncake session id -> decode endpoint"""
        self._server = BootstrapServer(aiohttp) if identity.bootstrap_port else None
        """leader only: the bootstrap HTTP server"""
        self._last_warn = 0.0

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await super().start()
        await self._bootstrap.start()
        if self._server is not None:
            await self._server.start(self.me.host, self.me.bootstrap_port)
            self._server.register(registration_body(self.me, self.endpoint))

    async def aclose(self, linger: float = 0.5) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            await self._server.aclose()
        await self._bootstrap.aclose()
        await super().aclose(linger)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _deliver(self, msg: Message) -> None:
        self.received += 1
        result = self._handler(msg)
        if result is not None:
            self._spawn(result)

    # -- outbound -------------------------------------------------------------------------------
    def try_send(self, endpoint: str, msg: Message, *, yield_cpu: bool = False) -> bool:
        """Never sends: SGLang's frames are built by :meth:`send` only, so callers take that path."""
        return False

    async def send(self, endpoint: str, msg: Message, *, timeout: float, yield_cpu: bool = False) -> None:
        """Translate one internal message into SGLang's protocol (see the package table)."""
        port = self.endpoint.rpartition(":")[2]
        if isinstance(msg, TopologyQuery):
            self._spawn(self._query_topology(endpoint, msg))
        elif isinstance(msg, Hello):
            self._own_session = msg.session_id
            await self.send_frames(endpoint, register_frames(msg, self.me, port), timeout=timeout)
            self._deliver(HelloAck(version=PROTOCOL_VERSION, endpoint=endpoint, generation=msg.generation,
                                   accepted=True, engine=self.me.engine,
                                   rank=self._bootstrap.rank_ids.get(endpoint, 0)))
        elif isinstance(msg, TransferRequest):
            if not msg.is_dummy:
                rank = self._bootstrap.rank_ids.get(endpoint, 0)
                self._room_targets.setdefault(msg.room, {})[rank] = endpoint
                while len(self._room_targets) > _MAX_TRACKED_ROOMS:
                    self._room_targets.popitem(last=False)
            frames = metadata_frames(msg, self.me, port, self._own_session)
            await self.send_frames(endpoint, frames, timeout=timeout)
        elif isinstance(msg, Status):
            await self.send_frames(endpoint, status_frames(msg, self.me), timeout=timeout, yield_cpu=yield_cpu)
        elif isinstance(msg, AuxData):
            await self.send_frames(endpoint, aux_frames(msg), timeout=timeout)
        elif isinstance(msg, Abort):
            if endpoint in self._sessions:
                return  # SGLang decodes are not told about prefill-side aborts (they time out on their own)
            await self.send_frames(endpoint, abort_frames(msg.room, self.me, port), timeout=timeout)
        elif isinstance(msg, RankRegister):
            self._spawn(self._bootstrap.put_route(endpoint, registration_body(self.me, self.endpoint)))
        elif isinstance(msg, Ping):
            self._spawn(self._ping(endpoint, msg))
        # HelloAck, Pong, Topology and staging messages have no SGLang counterpart: nothing is sent.

    _own_session = ""
    """Our Mooncake session id, learned from the first Hello we send (SGLang metadata repeats it)."""

    async def _query_topology(self, bootstrap: str, q: TopologyQuery) -> None:
        self._deliver(await self._bootstrap.topology(bootstrap, q, self.me))

    async def _ping(self, endpoint: str, msg: Ping) -> None:
        if endpoint in self._sessions:
            # SGLang decodes have no liveness probe: their liveness comes from the engine and timeouts.
            self._deliver(Pong(endpoint=endpoint, nonce=msg.nonce, incarnation=self._sessions[endpoint].generation))
            return
        if await self._bootstrap.healthy(endpoint):
            self._deliver(Pong(endpoint=endpoint, nonce=msg.nonce, incarnation=0))

    # -- inbound --------------------------------------------------------------------------------
    def parse(self, frames: list[bytes]) -> Message | None:
        """Translate one SGLang multipart message (raises :class:`ProtocolError`; None = consumed here)."""
        if not frames or sum(len(f) for f in frames) > self._max_bytes:
            raise ProtocolError("empty or oversized message")
        tag = frames[0]
        if tag == b"None":
            return self._parse_register(frames)
        if tag == b"AUX_DATA":
            return decode_aux(frames, lambda room: next(iter(self._room_targets.get(room, {}).values()), ""))
        if tag == b"ABORT":
            abort, ack = decode_abort(frames, self.me)
            if ack is not None:
                self._spawn(self._ack_later(abort.endpoint, ack))
            return abort
        if tag == b"ABORT_ACK":
            return None
        if len(frames) == 3:
            return decode_status(frames, lambda room, rank: self._room_targets.get(room, {}).get(rank, ""))
        if len(frames) >= 8:
            return decode_metadata(frames, self._generation_of)
        raise ProtocolError(f"unrecognised {len(frames)}-frame message")

    def _parse_register(self, f: list[bytes]) -> Hello:
        reg = decode_register(f)
        endpoint, session = reg.endpoint, reg.session
        old = self._sessions.get(endpoint)
        gen = (hash(session) & ((1 << 61) - 1)) + (old.registrations if old else 0)
        self._sessions[endpoint] = _DecodeSession(endpoint, gen, (old.registrations + 1) if old else 1)
        self._by_session[session] = endpoint
        return hello_from_register(reg, self.me, gen)

    def _generation_of(self, session: str, endpoint: str) -> int:
        if self._by_session.get(session) != endpoint or endpoint not in self._sessions:
            raise ProtocolError("metadata from a decode session that never registered")
        return self._sessions[endpoint].generation

    async def _ack_later(self, endpoint: str, frames: list[bytes]) -> None:
        await asyncio.sleep(0)  # after the handler marked the room failed
        with contextlib.suppress(Exception):
            await self.send_frames(endpoint, frames, timeout=1.0)
