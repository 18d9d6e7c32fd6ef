"""The bootstrap leader of a prefill deployment: collects every prefill rank's control endpoint and
answers decode ranks' topology queries once all are in. Non-leader ranks register with it."""

from __future__ import annotations

import logging

from .._control.endpoint import normalize_endpoint
from .._control.messages import PROTOCOL_VERSION, RankEndpoint, RankRegister, Topology, TopologyQuery
from .._deadline import Deadline
from ..errors import InvalidArgument
from .context import RankContext

__all__ = ["BootstrapLeader"]

log = logging.getLogger("aiotransfer.manager")


class BootstrapLeader:
    def __init__(self, ctx: RankContext) -> None:
        self._ctx = ctx
        self.ranks: dict[tuple[int, int, int, int], str] = {}
        """(dp, tp, pp, cp) -> control endpoint of every prefill rank registered (this one included)."""

    def add_self(self) -> None:
        p = self._ctx.parallel
        self.ranks[(p.dp_rank, p.tp_rank, p.pp_rank, p.cp_rank)] = self._ctx.endpoint

    def register_msg(self) -> RankRegister:
        ctx = self._ctx
        a, p = ctx.args, ctx.parallel
        return RankRegister(
            version=PROTOCOL_VERSION,
            rank=RankEndpoint(p.dp_rank, p.tp_rank, p.pp_rank, p.cp_rank, ctx.endpoint),
            tp_size=p.tp_size, pp_size=p.pp_size, cp_size=p.cp_size, dp_size=ctx.config.dp_size,
            layout=a.layout, total_kv_heads=a.total_kv_heads, page_size=a.page_size,
        )

    async def register_with(self, leader: str) -> None:
        """Non-leader prefill rank: announce this rank to the bootstrap leader (fire and forget; the
        leader answers topology queries only once every rank is in, and decode retries until then)."""
        try:
            endpoint = normalize_endpoint(leader)
        except ValueError as exc:
            raise InvalidArgument(f"bootstrap: {exc}") from None
        await self._ctx.send(endpoint, self.register_msg(), Deadline(self._ctx.config.handshake_timeout))

    def topology(self, nonce: int) -> Topology:
        ctx = self._ctx
        p, a, cfg = ctx.parallel, ctx.args, ctx.config
        if cfg.bootstrap:
            return Topology(version=PROTOCOL_VERSION, nonce=nonce, ready=False,
                            reason="not the bootstrap leader", redirect=normalize_endpoint(cfg.bootstrap))
        expected = cfg.dp_size * p.tp_size * p.pp_size * p.cp_size
        ready = len(self.ranks) >= expected
        return Topology(
            version=PROTOCOL_VERSION, nonce=nonce, ready=ready,
            reason="" if ready else f"{len(self.ranks)}/{expected} prefill ranks registered",
            tp_size=p.tp_size, pp_size=p.pp_size, cp_size=p.cp_size, dp_size=cfg.dp_size,
            layout=a.layout, total_kv_heads=a.total_kv_heads, page_size=a.page_size,
            ranks=[RankEndpoint(*key, ep) for key, ep in sorted(self.ranks.items())] if ready else [],
        )

    def on_query(self, msg: TopologyQuery) -> None:
        self._ctx.answer(msg.endpoint, self.topology(msg.nonce), "topology")

    def on_register(self, msg: RankRegister) -> None:
        ctx = self._ctx
        p, cfg = ctx.parallel, ctx.config
        if cfg.bootstrap:
            ctx.drop("not-leader", f"rank registration from {msg.rank.endpoint}")
            return
        if (msg.tp_size, msg.pp_size, msg.cp_size, msg.dp_size) != (p.tp_size, p.pp_size, p.cp_size, cfg.dp_size):
            ctx.drop("bad-rank", f"{msg.rank.endpoint} reports a different topology")
            log.warning("prefill rank %s reports sizes tp=%d pp=%d cp=%d dp=%d; leader has tp=%d pp=%d cp=%d dp=%d",
                        msg.rank.endpoint, msg.tp_size, msg.pp_size, msg.cp_size, msg.dp_size,
                        p.tp_size, p.pp_size, p.cp_size, cfg.dp_size)
            return
        r = msg.rank
        self.ranks[(r.dp_rank, r.tp_rank, r.pp_rank, r.cp_rank)] = r.endpoint
