"""SGLang 0.5.x wire profile (``TransferConfig(wire="sglang-mooncake")``).

A control plane with the same interface as :class:`~aiotransfer.control.endpoint.ControlPlane` that speaks
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
Needs ``aiohttp`` (``pip install aiotransfer[sglang]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import EngineUnavailable, ProtocolError
from .endpoint import ControlPlane
from .messages import (
    PROTOCOL_VERSION,
    Abort,
    AuxData,
    BufferSpec,
    Hello,
    HelloAck,
    Message,
    Ping,
    Pong,
    RankEndpoint,
    RankRegister,
    Status,
    Topology,
    TopologyQuery,
    TransferRequest,
)

__all__ = ["SGLANG_VERSION", "SglangControlPlane", "SglangIdentity", "pack_int_lists", "unpack_int_lists"]

log = logging.getLogger("aiotransfer.control.sglang")

SGLANG_VERSION = "0.5.23"
"""The SGLang release this profile was checked against (frames are stable across 0.5.x)."""
_HTTP_TIMEOUT = 5.0
_MAX_TRACKED_ROOMS = 1 << 16
_REMOTE_EXTENT = 1 << 40
"""SGLang registrations carry no buffer sizes: a remote buffer is taken to span this many bytes (the
engine itself refuses writes outside the decode's registered memory)."""
_TOPOLOGY_KEYS = (
    "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype", "follow_bootstrap_room",
    "enable_dsa_cache_layer_split", "decode_allocation_policy", "enable_kv_cache_sharding", "prefill_http_port",
    "target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks", "required_dst_info_num",
    "required_prefill_response_num",
)
Handler = Callable[[Message], Awaitable[None] | None]


def pack_int_lists(lists: list[list[int]], fmt: str) -> bytes:
    """SGLang's list-of-int-lists framing: u32 count, u32 byte lengths, packed arrays (all little-endian)."""
    if not lists:
        return b""
    parts = [struct.pack(f"<{len(x)}{fmt}", *x) for x in lists]
    return struct.pack(f"<I{len(parts)}I", len(parts), *(len(p) for p in parts)) + b"".join(parts)


def unpack_int_lists(data: bytes, fmt: str) -> list[list[int]]:
    if not data:
        return []
    (n,) = struct.unpack_from("<I", data, 0)
    if n > 1 << 16 or len(data) < 4 + 4 * n:
        raise ProtocolError("bad int-list framing")
    lens = struct.unpack_from(f"<{n}I", data, 4)
    size = struct.calcsize(fmt)
    out, off = [], 4 + 4 * n
    for nbytes in lens:
        if nbytes % size or off + nbytes > len(data):
            raise ProtocolError("bad int-list framing")
        out.append(list(struct.unpack_from(f"<{nbytes // size}{fmt}", data, off)))
        off += nbytes
    return out


def _int(frame: bytes, what: str) -> int:
    try:
        return int(frame.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"{what} is not an ASCII integer") from None


def _u64s(frame: bytes, what: str) -> list[int]:
    if len(frame) % 8:
        raise ProtocolError(f"{what} is not a whole u64 array")
    return [int(x) for x in np.frombuffer(frame, dtype="<u8")]


@dataclass(frozen=True)
class SglangIdentity:
    """What the profile must know about its own manager (SGLang frames leave these implicit)."""

    host: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int
    dp_rank: int
    dp_size: int
    page_size: int
    kv_cache_dtype: str
    is_mla: bool
    kv_heads: int
    total_kv_heads: int
    aux_item_lens: tuple[int, ...]
    compat: str
    layout: str
    engine: str = "mooncake"
    bootstrap_port: int = 0
    """Leader only: serve SGLang's bootstrap HTTP API on this port (0: not the leader)."""

    @property
    def unique_rank(self) -> int:
        return self.tp_rank * (self.pp_size * self.cp_size) + self.pp_rank * self.cp_size + self.cp_rank


@dataclass
class _DecodeSession:
    """Prefill side: one SGLang decode rank that registered."""

    endpoint: str
    generation: int
    registrations: int = 1


@dataclass
class _BootstrapTable:
    """Leader side: the ``PUT /route`` registrations, as SGLang's bootstrap server keeps them."""

    info: dict[str, Any] | None = None
    ranks: dict[tuple[int, int, int, int], dict[str, Any]] = field(default_factory=dict)
    count: int = 0


class SglangControlPlane(ControlPlane):
    """See the module docstring. A ``ControlPlane`` whose frames are SGLang's (no HMAC: SGLang has none)."""

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
        self._aiohttp = aiohttp
        self.me = identity
        self._tasks: set[asyncio.Task[Any]] = set()
        self._http: Any = None
        self._runner: Any = None
        # decode side
        self._rank_bootstrap: dict[str, str] = {}
        """prefill rank endpoint -> its bootstrap HTTP address"""
        self._rank_ids: dict[str, int] = {}
        self._room_targets: OrderedDict[int, dict[int, str]] = OrderedDict()
        """decode side: room -> {prefill_unique_rank: endpoint} of the ranks we sent real metadata to
        (SGLang's status and AUX_DATA frames name a rank or nothing, never an endpoint)"""
        """prefill rank endpoint -> prefill_unique_rank"""
        # prefill side
        self._sessions: dict[str, _DecodeSession] = {}
        """decode endpoint -> registration"""
        self._by_session: dict[str, str] = {}
        """decode Mooncake session id -> decode endpoint"""
        self._table = _BootstrapTable()
        self._last_warn = 0.0

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await super().start()
        self._http = self._aiohttp.ClientSession(timeout=self._aiohttp.ClientTimeout(total=_HTTP_TIMEOUT))
        if self.me.bootstrap_port:
            await self._serve_bootstrap()
            self._table_register(self._own_registration())

    async def aclose(self, linger: float = 0.5) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()
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
        """Translate one internal message into SGLang's protocol (see the module table)."""
        if isinstance(msg, TopologyQuery):
            self._spawn(self._query_topology(endpoint, msg))
        elif isinstance(msg, Hello):
            self._own_session = msg.session_id
            await self.send_frames(endpoint, self._register_frames(msg), timeout=timeout)
            self._deliver(HelloAck(version=PROTOCOL_VERSION, endpoint=endpoint, generation=msg.generation,
                                   accepted=True, engine=self.me.engine, rank=self._rank_ids.get(endpoint, 0)))
        elif isinstance(msg, TransferRequest):
            if not msg.is_dummy:
                self._room_targets.setdefault(msg.room, {})[self._rank_ids.get(endpoint, 0)] = endpoint
                while len(self._room_targets) > _MAX_TRACKED_ROOMS:
                    self._room_targets.popitem(last=False)
            await self.send_frames(endpoint, self._metadata_frames(msg), timeout=timeout)
        elif isinstance(msg, Status):
            await self.send_frames(endpoint, [str(msg.room).encode(), str(msg.status).encode(),
                                        str(self.me.unique_rank).encode()], timeout=timeout, yield_cpu=yield_cpu)
        elif isinstance(msg, AuxData):
            await self.send_frames(endpoint, [b"AUX_DATA", str(msg.room).encode(), str(msg.buffer).encode(),
                                        str(msg.index).encode(), struct.pack(">I", len(msg.data)), msg.data], timeout=timeout)
        elif isinstance(msg, Abort):
            if endpoint in self._sessions:
                return  # SGLang decodes are not told about prefill-side aborts (they time out on their own)
            await self.send_frames(endpoint, [b"ABORT", str(msg.room).encode(), self.me.host.encode(),
                                        self.endpoint.rpartition(":")[2].encode()], timeout=timeout)
        elif isinstance(msg, RankRegister):
            self._spawn(self._put_route(endpoint, msg))
        elif isinstance(msg, Ping):
            self._spawn(self._ping(endpoint, msg))
        # HelloAck, Pong, Topology and staging messages have no SGLang counterpart: nothing is sent.

    def _register_frames(self, h: Hello) -> list[bytes]:
        kv = np.array([b.ptr for b in h.kv], dtype="<u8").tobytes()
        aux = np.array([b.ptr for b in h.aux], dtype="<u8").tobytes()
        lens = np.array([b.item_len for b in h.kv], dtype="<u8").tobytes()
        port = self.endpoint.rpartition(":")[2]
        return [
            b"None", self.me.host.encode(), port.encode(), h.session_id.encode(), kv, aux, b"",
            str(h.tp_rank).encode(), str(h.tp_size).encode(), str(h.kv[0].item_len if h.kv else 0).encode(),
            b"", b"", b"", b"", b"", b"", b"1", b"0", b"", lens,
        ]

    def _metadata_frames(self, r: TransferRequest) -> list[bytes]:
        if r.state_indices:
            raise ProtocolError("the SGLang profile does not carry state (Mamba/SWA/NSA) indices")
        port = self.endpoint.rpartition(":")[2]
        session = self._own_session
        aux = b"" if r.is_dummy else str(max(r.aux_index, 0)).encode()
        return [
            str(r.room).encode(), self.me.host.encode(), port.encode(), session.encode(),
            b"" if r.is_dummy else r.kv_indices, aux, b"", str(r.required_dst_info_num).encode(), b"0", b"",
        ]

    _own_session = ""
    """Our Mooncake session id, learned from the first Hello we send (SGLang metadata repeats it)."""

    # -- decode side: HTTP bootstrap ---------------------------------------------------------------
    def _http_base(self, endpoint: str) -> str:
        return "http://" + endpoint[len("tcp://"):] if endpoint.startswith("tcp://") else "http://" + endpoint

    async def _get_json(self, url: str, params: dict[str, int]) -> tuple[int, Any]:
        async with self._http.get(url, params={k: str(v) for k, v in params.items()}) as resp:
            if resp.status != 200:
                return resp.status, await resp.text()
            return 200, await resp.json(content_type=None)

    async def _query_topology(self, bootstrap: str, q: TopologyQuery) -> None:
        base = self._http_base(bootstrap) + "/route"
        try:
            status, info = await self._get_json(base, {"prefill_dp_rank": -1, "prefill_cp_rank": -1,
                                                       "target_tp_rank": -1, "target_pp_rank": -1})
            if status != 200:
                self._deliver(Topology(version=PROTOCOL_VERSION, nonce=q.nonce, ready=False,
                                       reason=f"bootstrap answered {status}: {str(info)[:200]}"))
                return
            reason = self._topology_problem(info)
            if reason:
                self._deliver(Topology(version=PROTOCOL_VERSION, nonce=q.nonce, ready=False,
                                       reason="refused: " + reason))
                return
            tp, cp, dp, pp = (int(info[k]) for k in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size"))
            ranks = []
            for d in range(dp):
                for c in range(cp):
                    for t in range(tp):
                        for p in range(pp):
                            st, rank = await self._get_json(base, {"prefill_dp_rank": d, "prefill_cp_rank": c,
                                                                   "target_tp_rank": t, "target_pp_rank": p})
                            if st != 200:
                                raise ProtocolError(f"GET /route for rank dp={d} cp={c} tp={t} pp={p}: {st}")
                            ep = f"tcp://{rank['rank_ip']}:{int(rank['rank_port'])}"
                            self._rank_bootstrap[ep] = bootstrap
                            self._rank_ids[ep] = t * (pp * cp) + p * cp + c
                            ranks.append(RankEndpoint(d, t, p, c, ep))
            self._deliver(Topology(
                version=PROTOCOL_VERSION, nonce=q.nonce, ready=True, tp_size=tp, pp_size=pp, cp_size=cp,
                dp_size=dp, layout=self.me.layout, total_kv_heads=0, page_size=int(info["page_size"]), ranks=ranks,
            ))
        except (self._aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._deliver(Topology(version=PROTOCOL_VERSION, nonce=q.nonce, ready=False,
                                   reason=f"bootstrap {bootstrap} unreachable: {exc!r}"))
        except (ProtocolError, KeyError, TypeError, ValueError) as exc:
            self._deliver(Topology(version=PROTOCOL_VERSION, nonce=q.nonce, ready=False,
                                   reason=f"refused: malformed bootstrap answer from {bootstrap}: {exc}"))

    def _topology_problem(self, info: Any) -> str | None:
        if not isinstance(info, dict):
            return "topology is not a JSON object"
        missing = [k for k in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype")
                   if k not in info]
        if missing:
            return f"topology lacks {missing} (is this SGLang {SGLANG_VERSION}?)"
        if int(info["page_size"]) != self.me.page_size:
            return f"page size mismatch: prefill {info['page_size']}, ours {self.me.page_size}"
        if str(info["kv_cache_dtype"]) != self.me.kv_cache_dtype:
            return f"kv_cache_dtype mismatch: prefill {info['kv_cache_dtype']!r}, ours {self.me.kv_cache_dtype!r}"
        if info.get("decode_allocation_policy", "early") != "early":
            return "the prefill uses the prefill_complete allocation policy, which the profile does not support"
        return None

    async def _ping(self, endpoint: str, msg: Ping) -> None:
        if endpoint in self._sessions:
            # SGLang decodes have no liveness probe: their liveness comes from the engine and timeouts.
            self._deliver(Pong(endpoint=endpoint, nonce=msg.nonce, incarnation=self._sessions[endpoint].generation))
            return
        bootstrap = self._rank_bootstrap.get(endpoint)
        if bootstrap is None:
            return
        with contextlib.suppress(self._aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with self._http.get(self._http_base(bootstrap) + "/health") as resp:
                if resp.status == 200:
                    self._deliver(Pong(endpoint=endpoint, nonce=msg.nonce, incarnation=0))

    # -- prefill side: HTTP bootstrap server --------------------------------------------------------
    def _own_registration(self) -> dict[str, Any]:
        m = self.me
        host, _, port = self.endpoint[len("tcp://"):].rpartition(":")
        return {
            "attn_tp_size": m.tp_size, "attn_tp_rank": m.tp_rank, "attn_cp_size": m.cp_size, "attn_cp_rank": m.cp_rank,
            "attn_dp_size": m.dp_size, "attn_dp_rank": m.dp_rank, "pp_size": m.pp_size, "pp_rank": m.pp_rank,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": host, "rank_port": int(port),
            "page_size": m.page_size, "kv_cache_dtype": m.kv_cache_dtype,
            "load_balance_method": "follow_bootstrap_room",
        }

    def _table_register(self, body: dict[str, Any]) -> None:
        t = self._table
        if t.info is None:
            t.info = {
                "attn_tp_size": int(body["attn_tp_size"]), "attn_cp_size": int(body["attn_cp_size"]),
                "dp_size": int(body["attn_dp_size"]) if int(body.get("system_dp_size", 1)) == 1
                else int(body["system_dp_size"]),
                "pp_size": int(body["pp_size"]), "page_size": int(body["page_size"]),
                "kv_cache_dtype": str(body["kv_cache_dtype"]),
                "follow_bootstrap_room": body.get("load_balance_method", "follow_bootstrap_room")
                == "follow_bootstrap_room",
                "enable_dsa_cache_layer_split": False, "decode_allocation_policy": "early",
                "enable_kv_cache_sharding": False, "prefill_http_port": int(body.get("prefill_http_port", 0)),
            }
        dp = int(body["attn_dp_rank"]) if int(body.get("system_dp_size", 1)) == 1 else int(body["system_dp_rank"])
        key = (dp, int(body["attn_cp_rank"]), int(body["attn_tp_rank"]), int(body["pp_rank"]))
        t.ranks[key] = {"rank_ip": str(body["rank_ip"]), "rank_port": int(body["rank_port"])}
        t.count += 1

    async def _serve_bootstrap(self) -> None:
        web = importlib_web(self._aiohttp)

        async def route(request: Any) -> Any:
            if request.method == "PUT":
                try:
                    self._table_register(await request.json())
                except (ValueError, KeyError, TypeError) as exc:
                    return web.Response(status=400, text=f"bad registration: {exc}")
                return web.Response(text="OK")
            q = request.query
            try:
                d, c, t, p = (int(q[k]) for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank",
                                                   "target_pp_rank"))
            except KeyError:
                return web.Response(status=400, text="Missing inputs for bootstrap server.")
            except ValueError:
                return web.Response(status=400, text="bootstrap parameters must be integers")
            info = self._table.info
            if info is None or self._table.count < info["dp_size"] * info["attn_cp_size"] * info[
                    "attn_tp_size"] * info["pp_size"]:
                return web.Response(status=503, text=f"Prefill server not fully registered yet "
                                                     f"({self._table.count} workers registered).")
            if (d, c, t, p) == (-1, -1, -1, -1):
                body = {k: info.get(k) for k in _TOPOLOGY_KEYS}
                return web.json_response(body)
            entry = self._table.ranks.get((d, c, t, p))
            if entry is None:
                return web.Response(status=404, text=f"Bootstrap info not found for dp_rank={d} cp_rank={c} "
                                                     f"tp_rank={t} pp_rank={p}")
            return web.json_response(entry)

        async def health(request: Any) -> Any:
            return web.Response(text="OK")

        app = web.Application()
        app.router.add_route("*", "/route", route)
        app.router.add_get("/health", health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.me.host, self.me.bootstrap_port)
        await site.start()

    async def _put_route(self, endpoint: str, msg: RankRegister) -> None:
        body = self._own_registration()
        url = self._http_base(endpoint) + "/route"
        for attempt in range(5):
            with contextlib.suppress(self._aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with self._http.put(url, json=body) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(min(2**attempt * 0.2, 2.0))
        log.error("could not register this prefill rank with the SGLang bootstrap server at %s", url)

    # -- inbound --------------------------------------------------------------------------------
    def parse(self, frames: list[bytes]) -> Message | None:
        """Translate one SGLang multipart message (raises :class:`ProtocolError`; None = consumed here)."""
        if not frames or sum(len(f) for f in frames) > self._max_bytes:
            raise ProtocolError("empty or oversized message")
        tag = frames[0]
        if tag == b"None":
            return self._parse_register(frames)
        if tag == b"AUX_DATA":
            if len(frames) < 6 or len(frames[4]) != 4:
                raise ProtocolError("malformed AUX_DATA")
            (n,) = struct.unpack(">I", frames[4])
            if n != len(frames[5]):
                raise ProtocolError("AUX_DATA length mismatch")
            room = _int(frames[1], "room")
            return AuxData(room=room, buffer=_int(frames[2], "aux buffer"),
                           index=_int(frames[3], "aux slot"), data=frames[5],
                           endpoint=next(iter(self._room_targets.get(room, {}).values()), ""))
        if tag == b"ABORT":
            return self._parse_abort(frames)
        if tag == b"ABORT_ACK":
            return None
        if len(frames) == 3:
            room, status, rank = (_int(f, "status field") for f in frames)
            if status not in (0, 4):
                raise ProtocolError(f"unexpected status {status}")
            return Status(room=room, status=status, rank=rank, endpoint=self._room_targets.get(room, {}).get(rank, ""),
                          reason="" if status == 4 else "the SGLang prefill reported failure (no reason on the wire)")
        if len(frames) >= 8:
            return self._parse_metadata(frames)
        raise ProtocolError(f"unrecognised {len(frames)}-frame message")

    def _parse_register(self, f: list[bytes]) -> Hello:
        if len(f) < 10:
            raise ProtocolError(f"register message has {len(f)} frames, needs at least 10")
        ip = f[1].decode("ascii", "replace")
        port = _int(f[2], "rank port")
        session = f[3].decode("ascii", "replace")
        if ":" not in session:
            raise ProtocolError("session id is not host:port")
        kv_ptrs = _u64s(f[4], "KV addresses")
        aux_ptrs = _u64s(f[5], "aux addresses")
        if f[6] and any(unpack_int_lists(f[6], "Q")):
            raise ProtocolError("state buffers are not supported by the SGLang profile")
        tp_rank, tp_size, first_len = _int(f[7], "tp rank"), _int(f[8], "tp size"), _int(f[9], "item length")
        lens = _u64s(f[19], "KV item lengths") if len(f) > 19 and f[19] else [first_len] * len(kv_ptrs)
        layer_ids = list(np.frombuffer(f[12], dtype="<u4")) if len(f) > 12 and f[12] and len(f[12]) % 4 == 0 else []
        if len(lens) != len(kv_ptrs) or tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ProtocolError("inconsistent register message")
        endpoint = f"tcp://{ip}:{port}"
        old = self._sessions.get(endpoint)
        gen = (hash(session) & ((1 << 61) - 1)) + (old.registrations if old else 0)
        self._sessions[endpoint] = _DecodeSession(endpoint, gen, (old.registrations + 1) if old else 1)
        self._by_session[session] = endpoint
        me = self.me
        heads = (me.total_kv_heads // tp_size if tp_size <= me.total_kv_heads else 1) if me.total_kv_heads else 0
        kv = [BufferSpec(p, n * (_REMOTE_EXTENT // max(n, 1)), n,
                         int(layer_ids[i]) if i < len(layer_ids) else -1) for i, (p, n) in enumerate(zip(kv_ptrs, lens, strict=True))]
        aux = [BufferSpec(p, n * (_REMOTE_EXTENT // max(n, 1)), n)
               for p, n in zip(aux_ptrs, me.aux_item_lens, strict=False)]
        return Hello(
            version=PROTOCOL_VERSION, endpoint=endpoint, generation=gen, engine=me.engine, session_id=session,
            engine_info=b"", probe_addr=0, compat=me.compat, kv=kv, aux=aux, layout=me.layout, tp_size=tp_size,
            tp_rank=tp_rank, kv_heads=heads, total_kv_heads=me.total_kv_heads, page_size=me.page_size,
        )

    def _parse_metadata(self, f: list[bytes]) -> TransferRequest:
        room = _int(f[0], "room")
        endpoint = f"tcp://{f[1].decode('ascii', 'replace')}:{_int(f[2], 'rank port')}"
        session = f[3].decode("ascii", "replace")
        if self._by_session.get(session) != endpoint or endpoint not in self._sessions:
            raise ProtocolError("metadata from a decode session that never registered")
        if len(f[4]) % 4:
            raise ProtocolError("page indices are not a whole int32 array")
        dummy = not f[4] and not f[5]
        if f[6] and any(unpack_int_lists(f[6], "i")):
            raise ProtocolError("state indices are not supported by the SGLang profile")
        return TransferRequest(
            room=room, endpoint=endpoint, generation=self._sessions[endpoint].generation, kv_indices=bytes(f[4]),
            aux_index=-1 if dummy or not f[5] else _int(f[5], "aux slot"), state_indices={},
            required_dst_info_num=_int(f[7], "required_dst_info_num"), is_dummy=dummy,
        )

    def _parse_abort(self, f: list[bytes]) -> Abort | None:
        room = _int(f[1], "room") if len(f) > 1 else -1
        if room < 0:
            raise ProtocolError("ABORT without a room")
        endpoint = f"tcp://{f[2].decode('ascii', 'replace')}:{_int(f[3], 'port')}" if len(f) > 3 else ""
        if len(f) > 4 and endpoint:
            ack = [b"ABORT_ACK", str(room).encode(), str(self.me.unique_rank).encode(), bytes(f[4])]
            self._spawn(self._ack_later(endpoint, ack))
        return Abort(room=room, endpoint=endpoint, reason="aborted by the SGLang decode")

    async def _ack_later(self, endpoint: str, frames: list[bytes]) -> None:
        await asyncio.sleep(0)  # after the handler marked the room failed
        with contextlib.suppress(Exception):
            await self.send_frames(endpoint, frames, timeout=1.0)


def importlib_web(aiohttp: Any) -> Any:
    from aiohttp import web

    return web
