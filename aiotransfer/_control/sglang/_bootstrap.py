"""SGLang's bootstrap HTTP API (aiohttp): the server a prefill leader runs, and the client decodes use.

* :class:`BootstrapServer`   -- ``PUT /route`` registrations, ``GET /route`` lookups, ``GET /health``,
                                answering as SGLang's own bootstrap server does
* :class:`BootstrapClient`   -- the topology query (``GET /route``: all ``-1``, then each rank), rank
                                registration (``PUT /route``) and liveness (``GET /health``)
* :func:`registration_body`  -- what a prefill rank registers about itself
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from ...errors import ProtocolError
from ..messages import PROTOCOL_VERSION, RankEndpoint, Topology, TopologyQuery
from ._frames import SGLANG_VERSION, SglangIdentity

__all__ = ["BootstrapClient", "BootstrapServer", "registration_body", "topology_problem"]

log = logging.getLogger("aiotransfer.control.sglang")

HTTP_TIMEOUT = 5.0
_TOPOLOGY_KEYS = (
    "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype", "follow_bootstrap_room",
    "enable_dsa_cache_layer_split", "decode_allocation_policy", "enable_kv_cache_sharding", "prefill_http_port",
    "target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks", "required_dst_info_num",
    "required_prefill_response_num",
)


def http_base(endpoint: str) -> str:
    return "http://" + endpoint[len("tcp://"):] if endpoint.startswith("tcp://") else "http://" + endpoint


def registration_body(me: SglangIdentity, endpoint: str) -> dict[str, Any]:
    """The ``PUT /route`` body of the prefill rank serving ``endpoint``."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return {
        "attn_tp_size": me.tp_size, "attn_tp_rank": me.tp_rank, "attn_cp_size": me.cp_size, "attn_cp_rank": me.cp_rank,
        "attn_dp_size": me.dp_size, "attn_dp_rank": me.dp_rank, "pp_size": me.pp_size, "pp_rank": me.pp_rank,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": host, "rank_port": int(port),
        "page_size": me.page_size, "kv_cache_dtype": me.kv_cache_dtype,
        "load_balance_method": "follow_bootstrap_room",
    }


def topology_problem(info: Any, me: SglangIdentity) -> str | None:
    """Why a prefill's topology answer is refused, or None."""
    if not isinstance(info, dict):
        return "topology is not a JSON object"
    missing = [k for k in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype")
               if k not in info]
    if missing:
        return f"topology lacks {missing} (is this SGLang {SGLANG_VERSION}?)"
    if int(info["page_size"]) != me.page_size:
        return f"page size mismatch: prefill {info['page_size']}, ours {me.page_size}"
    if str(info["kv_cache_dtype"]) != me.kv_cache_dtype:
        return f"kv_cache_dtype mismatch: prefill {info['kv_cache_dtype']!r}, ours {me.kv_cache_dtype!r}"
    if info.get("decode_allocation_policy", "early") != "early":
        return "the prefill uses the prefill_complete allocation policy, which the profile does not support"
    return None


@dataclass
class _BootstrapTable:
    """The ``PUT /route`` registrations, as SGLang's bootstrap server keeps them."""

    info: dict[str, Any] | None = None
    ranks: dict[tuple[int, int, int, int], dict[str, Any]] = field(default_factory=dict)
    count: int = 0


class BootstrapServer:
    """The leader's bootstrap HTTP server."""

    def __init__(self, aiohttp: Any) -> None:
        self._aiohttp = aiohttp
        self.table = _BootstrapTable()
        self._runner: Any = None

    def register(self, body: dict[str, Any]) -> None:
        t = self.table
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

    async def start(self, host: str, port: int) -> None:
        from aiohttp import web

        async def route(request: Any) -> Any:
            if request.method == "PUT":
                try:
                    self.register(await request.json())
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
            info = self.table.info
            if info is None or self.table.count < info["dp_size"] * info["attn_cp_size"] * info[
                    "attn_tp_size"] * info["pp_size"]:
                return web.Response(status=503, text=f"Prefill server not fully registered yet "
                                                     f"({self.table.count} workers registered).")
            if (d, c, t, p) == (-1, -1, -1, -1):
                body = {k: info.get(k) for k in _TOPOLOGY_KEYS}
                return web.json_response(body)
            entry = self.table.ranks.get((d, c, t, p))
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
        site = web.TCPSite(self._runner, host, port)
        await site.start()

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class BootstrapClient:
    """HTTP client of prefill bootstrap servers; remembers which bootstrap and rank id each rank has."""

    def __init__(self, aiohttp: Any) -> None:
        self._aiohttp = aiohttp
        self._http: Any = None
        self.rank_bootstrap: dict[str, str] = {}
        """prefill rank endpoint -> its bootstrap HTTP address"""
        self.rank_ids: dict[str, int] = {}
        """prefill rank endpoint -> prefill_unique_rank"""
        self.errors: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
        """What a failed HTTP exchange raises."""

    async def start(self) -> None:
        self._http = self._aiohttp.ClientSession(timeout=self._aiohttp.ClientTimeout(total=HTTP_TIMEOUT))

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def _get_json(self, url: str, params: dict[str, int]) -> tuple[int, Any]:
        async with self._http.get(url, params={k: str(v) for k, v in params.items()}) as resp:
            if resp.status != 200:
                return resp.status, await resp.text()
            return 200, await resp.json(content_type=None)

    async def topology(self, bootstrap: str, q: TopologyQuery, me: SglangIdentity) -> Topology:
        """The prefill's topology as an internal ``Topology`` (``ready=False`` with a reason on failure)."""
        base = http_base(bootstrap) + "/route"
        try:
            status, info = await self._get_json(base, {"prefill_dp_rank": -1, "prefill_cp_rank": -1,
                                                       "target_tp_rank": -1, "target_pp_rank": -1})
            if status != 200:
                return Topology(version=PROTOCOL_VERSION, nonce=q.nonce, ready=False,
                                reason=f"bootstrap answered {status}: {str(info)[:200]}")
            reason = topology_problem(info, me)
            if reason:
                return Topology(version=PROTOCOL_VERSION, nonce=q.nonce, ready=False, reason="refused: " + reason)
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
                            self.rank_bootstrap[ep] = bootstrap
                            self.rank_ids[ep] = t * (pp * cp) + p * cp + c
                            ranks.append(RankEndpoint(d, t, p, c, ep))
            return Topology(
                version=PROTOCOL_VERSION, nonce=q.nonce, ready=True, tp_size=tp, pp_size=pp, cp_size=cp,
                dp_size=dp, layout=me.layout, total_kv_heads=0, page_size=int(info["page_size"]), ranks=ranks,
            )
        except self.errors as exc:
            return Topology(version=PROTOCOL_VERSION, nonce=q.nonce, ready=False,
                            reason=f"bootstrap {bootstrap} unreachable: {exc!r}")
        except (ProtocolError, KeyError, TypeError, ValueError) as exc:
            return Topology(version=PROTOCOL_VERSION, nonce=q.nonce, ready=False,
                            reason=f"refused: malformed bootstrap answer from {bootstrap}: {exc}")

    async def healthy(self, endpoint: str) -> bool:
        """The bootstrap server of prefill rank ``endpoint`` answers ``GET /health`` (False if unknown)."""
        bootstrap = self.rank_bootstrap.get(endpoint)
        if bootstrap is None:
            return False
        with contextlib.suppress(*self.errors):
            async with self._http.get(http_base(bootstrap) + "/health") as resp:
                return bool(resp.status == 200)
        return False

    async def put_route(self, bootstrap: str, body: dict[str, Any]) -> None:
        """Register a prefill rank with the leader's bootstrap server (retried with backoff, then logged)."""
        url = http_base(bootstrap) + "/route"
        for attempt in range(5):
            with contextlib.suppress(*self.errors):
                async with self._http.put(url, json=body) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(min(2**attempt * 0.2, 2.0))
        log.error("could not register this prefill rank with the SGLang bootstrap server at %s", url)
