"""The decode side's outbound half: resolve a prefill deployment's topology, register with its ranks,
and send each of them the room's transfer request."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import numpy as np

from .._control.messages import (
    PROTOCOL_VERSION,
    BufferSpec,
    Hello,
    HelloAck,
    StateSpec,
    Topology,
    TopologyQuery,
    TransferRequest,
    pack_indices,
)
from .._control.rendezvous import Rendezvous
from .._deadline import Deadline
from .._topology import map_ranks
from ..errors import IncompatiblePeer, PeerError
from .context import RankContext
from .peers import PrefillPeer, PrefillTopology
from .probe import port_refuses

_PROBE_AFTER = 0.5
"""Seconds without an answer after which first contact checks that the peer's port still accepts."""

__all__ = ["PrefillClient", "Route"]


@dataclass(frozen=True)
class Route:
    """Where one room's request goes: every prefill rank involved, and what each is asked."""

    sources: dict[str, int]
    """Prefill endpoint -> prefill rank, for every rank we expect a status (and data) from."""
    endpoints: list[str]
    """Every prefill rank involved, dummies included (they are told about aborts too)."""
    required: int
    """Success reports needed before the room succeeds."""
    requests: list[tuple[str, TransferRequest]]


class PrefillClient:
    """Topology cache, registrations with prefill ranks, and the answers they send back."""

    def __init__(self, ctx: RankContext) -> None:
        self._ctx = ctx
        self.topologies: dict[str, PrefillTopology] = {}
        self.peers: dict[str, PrefillPeer] = {}
        self._hellos: dict[str, asyncio.Task[PrefillPeer]] = {}
        self.acks: Rendezvous[int, HelloAck] = Rendezvous()
        self.topology_answers: Rendezvous[int, Topology] = Rendezvous()

    def on_hello_ack(self, msg: HelloAck) -> None:
        if not self.acks.resolve(msg.generation, msg):
            self._ctx.drop("unexpected-hello-ack", msg.endpoint)

    def on_topology(self, msg: Topology) -> None:
        if not self.topology_answers.resolve(msg.nonce, msg):
            self._ctx.drop("unexpected-topology", str(msg.nonce))

    def forget(self, endpoint: str) -> None:
        """A prefill rank died or restarted: its registration and the topologies naming it are stale."""
        self.peers.pop(endpoint, None)
        self._hellos.pop(endpoint, None)
        for key, topo in list(self.topologies.items()):
            if endpoint in topo.endpoints.values() or key == endpoint:
                del self.topologies[key]

    def known_ranks(self, peer: str) -> list[str]:
        """Every prefill rank of the cached topology behind bootstrap address ``peer`` (empty if unknown)."""
        topo = self.topologies.get(peer)
        return sorted(set(topo.endpoints.values())) if topo is not None else []

    # -- one room -----------------------------------------------------------------------------------
    async def route(
        self, room: int, peer: str, prefill_dp_rank: int | None, pages: np.ndarray, aux_index: int | None,
        states: dict[str, list[int]], deadline: Deadline, num_tokens: int = -1,
    ) -> Route:
        """Resolve the topology, register with every prefill rank involved, and build their requests."""
        ctx = self._ctx
        resolved = await self.topology(peer, deadline)
        topo = resolved.topo
        mapping = map_ranks(
            topo.tp_size, topo.pp_size, topo.cp_size, ctx.parallel,
            is_mla=topo.layout == "mla", total_heads=topo.total_kv_heads,
            all_cp_ranks_send=ctx.config.all_cp_ranks_send,
        )
        dp = prefill_dp_rank if prefill_dp_rank is not None else room % topo.dp_size
        endpoints = []
        for t in mapping.targets:
            ep = resolved.endpoints.get((dp, t.tp_rank, t.pp_rank, t.cp_rank))
            if ep is None:
                raise PeerError(f"prefill topology from {peer} lacks rank dp={dp} tp={t.tp_rank} pp={t.pp_rank}",
                                room=room, peer=peer)
            if ctx.liveness.is_dead(ep):
                raise PeerError(f"prefill rank {ep} was declared dead and has not answered since; probing it",
                                room=room, peer=ep)
            endpoints.append(ep)
        for ep in endpoints:
            ctx.liveness.activate(ep)
        unique = list(dict.fromkeys(endpoints))
        # Registered already, the usual case: no task to create, no loop iteration to wait for.
        registered = [p for ep in unique if (p := self.peers.get(ep)) is not None]
        if len(registered) != len(unique):
            registered = list(await asyncio.gather(*(self.register(ep, deadline) for ep in unique)))
        by_ep = {p.endpoint: p for p in registered}
        packed = pack_indices(pages)
        requests = [
            (ep, TransferRequest(
                room=room, endpoint=ctx.endpoint, generation=by_ep[ep].ack.generation,
                kv_indices=b"" if t.is_dummy else packed,
                aux_index=-1 if (aux_index is None or t.is_dummy) else aux_index,
                state_indices={} if t.is_dummy else states,
                required_dst_info_num=mapping.required_dst_info_num, is_dummy=t.is_dummy, num_tokens=num_tokens,
            ))
            for t, ep in zip(mapping.targets, endpoints, strict=True)
        ]
        return Route(
            sources={ep: t.unique_rank for t, ep in zip(mapping.targets, endpoints, strict=True) if not t.is_dummy},
            endpoints=list(dict.fromkeys(endpoints)), required=mapping.required_responses, requests=requests,
        )

    async def send_one(self, endpoint: str, req: TransferRequest, deadline: Deadline) -> None:
        await self._ctx.send(endpoint, req, deadline, yield_cpu=self._ctx.yield_after_notify())

    # -- registration ---------------------------------------------------------------------------------
    async def register(self, endpoint: str, deadline: Deadline) -> PrefillPeer:
        """Register this rank's buffers with a prefill rank (once per rank; concurrent callers share it)."""
        peer = self.peers.get(endpoint)
        if peer is not None:
            return peer
        task = self._hellos.get(endpoint)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.get_running_loop().create_task(self._register(endpoint, deadline.remaining(0.01)))
            self._hellos[endpoint] = task
        return await asyncio.shield(task)

    async def _register(self, endpoint: str, timeout: float) -> PrefillPeer:
        ctx = self._ctx
        hello = self.hello()
        deadline = Deadline(timeout)
        with self.acks.expect(hello.generation) as fut:
            await ctx.control.send(endpoint, hello, timeout=timeout)
            # Wait in slices: when nothing listens at the address any more, say so at once instead of
            # waiting out the whole budget.
            while (ack := await self.acks.wait(fut, min(deadline.remaining(0.0), _PROBE_AFTER))) is None:
                if deadline.expired or await port_refuses(endpoint):
                    break
        if ack is None:
            ctx.control.forget(endpoint)
            if not deadline.expired:
                raise PeerError(f"{endpoint} refuses connections: no manager listens there (its process is gone, "
                                "or the address is wrong)", peer=endpoint)
            raise PeerError(
                f"no registration answer from {endpoint} within {timeout:.3g}s "
                "(wrong address, peer down, or not an aiotransfer manager)", peer=endpoint,
            )
        if not ack.accepted:
            raise IncompatiblePeer(f"{endpoint} refused registration: {ack.reason}", peer=endpoint)
        if ack.incarnation:
            # a prefill that restarted shows it here, before any room is asked of the new process: rooms of
            # its old process fail now, not when a later heartbeat would also fail the new ones
            ctx.liveness.incarnation(endpoint, ack.incarnation)
        peer = PrefillPeer(endpoint, ack)
        self.peers[endpoint] = peer
        return peer

    def hello(self) -> Hello:
        """This rank's registration: engine session, buffers, geometry, staging arena, a fresh nonce."""
        ctx = self._ctx
        a, engine, arena = ctx.args, ctx.engine, ctx.arena
        probe = engine.probe_region
        return Hello(
            version=PROTOCOL_VERSION, endpoint=ctx.endpoint, generation=secrets.randbits(62), incarnation=ctx.generation,
            engine=ctx.engine_name, session_id=engine.session_id, engine_info=ctx.engine_info,
            probe_addr=probe.ptr if probe is not None else a.kv[0].ptr, compat=ctx.compat,
            kv=[BufferSpec(b.ptr, b.nbytes, b.item_len, b.layer_id) for b in a.kv],
            aux=[BufferSpec(b.ptr, b.nbytes, b.item_len) for b in a.aux],
            state=[
                StateSpec(kind, [BufferSpec(b.ptr, b.nbytes, b.item_len) for b in bufs], list(a.state_dims.get(kind, ())))
                for kind, bufs in a.state.items()
            ],
            layout=a.layout, tp_size=a.tp_size, tp_rank=a.tp_rank, pp_size=a.pp_size, pp_rank=a.pp_rank,
            kv_heads=a.kv_heads, total_kv_heads=a.total_kv_heads, page_size=a.page_size, cp_size=a.cp_size,
            cp_rank=a.cp_rank, outer=a.outer,
            staging=BufferSpec(arena.ptr, arena.nbytes, 1) if arena is not None else None,
            dtype=a.dtype, kv_device=a.kv_device, head_order=a.head_order, num_layers=a.num_layers,
        )

    # -- topology -----------------------------------------------------------------------------------
    async def topology(self, peer: str, deadline: Deadline) -> PrefillTopology:
        """Resolve a bootstrap address into the prefill topology (cached; retried until every rank is in)."""
        cached = self.topologies.get(peer)
        if cached is not None:
            return cached
        ctx = self._ctx
        if ctx.liveness.is_dead(peer):
            raise PeerError(f"prefill {peer} was declared dead and has not answered since; probing it", peer=peer)
        loop = asyncio.get_running_loop()
        target, delay, last = peer, 0.01, "no answer"
        while not deadline.expired:
            nonce = secrets.randbits(62)
            with self.topology_answers.expect(nonce) as fut:
                query = TopologyQuery(version=PROTOCOL_VERSION, endpoint=ctx.endpoint, nonce=nonce)
                await ctx.control.send(target, query, timeout=deadline.remaining(0.01))
                if deadline.expired:
                    break
                topo = await self.topology_answers.wait(fut, min(deadline.remaining(0.0), max(1.0, delay * 4)))
            if topo is None:
                last = "no answer"
                if await port_refuses(target):
                    raise PeerError(f"prefill {target} refuses connections: no manager listens there (its process "
                                    "is gone, or the address is wrong)", peer=peer)
                continue
            if topo.redirect:
                target = topo.redirect
                continue
            if topo.reason.startswith("refused:"):
                raise IncompatiblePeer(f"{peer}: {topo.reason[len('refused:'):].strip()}", peer=peer)
            if topo.ready:
                endpoints = {(r.dp_rank, r.tp_rank, r.pp_rank, r.cp_rank): r.endpoint for r in topo.ranks}
                resolved = PrefillTopology(topo, endpoints)
                self.topologies[peer] = resolved
                return resolved
            last = topo.reason
            await asyncio.sleep(min(delay, max(deadline.at - loop.time(), 0)))
            delay = min(delay * 2, 0.5)
        ctx.control.forget(peer)
        raise PeerError(
            f"no registration answer from {peer} within {deadline.budget:.3g}s ({last}; wrong address, peer down, "
            "or not an aiotransfer manager)", peer=peer,
        )
