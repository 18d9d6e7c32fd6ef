"""The engine process's side: a ``vllm.LLM`` (in-process engine core) and the commands the parent sends.

Imported only in the engine process (:mod:`~benchmarks.vllm.engine` spawns it), after the
environment is set; vLLM is imported here, lazily, so the module itself imports without it.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

from .spec import EngineSpec, kv_transfer_config

__all__ = ["Server"]

_IDLE_SLEEP = 0.0005
"""Pause between engine steps that produced nothing (a decode waiting for its KV)."""


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _external(request_id: str) -> str:
    """vLLM appends ``-<8 random chars>`` to a request id internally; the id the harness gave it."""
    head, _, tail = request_id.rpartition("-")
    return head if head and len(tail) == 8 else request_id


class Server:
    """One engine and its bookkeeping; ``cmd_*`` methods answer the parent's commands."""

    def __init__(self, spec: EngineSpec) -> None:
        t0 = time.monotonic()
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.spec = spec
        fields = kv_transfer_config(spec)
        ktc = KVTransferConfig(**fields) if fields is not None else None
        sizing: dict[str, Any] = {"block_size": spec.block_size} if spec.block_size is not None else {}
        if spec.max_num_batched_tokens is not None:
            sizing.update(max_num_batched_tokens=spec.max_num_batched_tokens, enable_chunked_prefill=True)
        self.llm: Any = LLM(model=spec.model, skip_tokenizer_init=True, enforce_eager=True,
                            max_model_len=spec.max_model_len, kv_cache_memory_bytes=spec.kv_cache_bytes,
                            enable_prefix_caching=False, kv_transfer_config=ktc, dtype=spec.dtype, seed=0,
                            **sizing)
        self.engine: Any = self.llm.llm_engine
        self.scheduler: Any = self.engine.engine_core.engine_core.scheduler
        self.pool: Any = self.scheduler.kv_cache_manager.block_pool
        self.free_idle = int(self.pool.get_num_free_blocks())
        self.ready_s = time.monotonic() - t0
        self._seq = 0
        self._nixl_xfers: list[tuple[float, int]] = []
        self._worker_connector = self._tap_connector()

    # -- connector access ------------------------------------------------------------------------
    def _tap_connector(self) -> Any:
        """The worker-role connector (same process); NixlConnector's per-transfer telemetry is collected
        as vLLM's model runner takes it each step."""
        if self.spec.kind == "single":
            return None
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        if self.spec.kind == "nixl":
            take = conn.get_kv_connector_stats

            def tapped() -> Any:
                stats = take()
                if stats is not None:
                    data = stats.data
                    self._nixl_xfers.extend(zip(data.get("transfer_duration", []),
                                                data.get("bytes_transferred", []), strict=False))
                return stats

            conn.get_kv_connector_stats = tapped
        return conn

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "kind": self.spec.kind, "role": self.spec.role, "ready_s": self.ready_s,
                "free_idle": self.free_idle, "num_blocks": int(self.pool.num_gpu_blocks),
                "block_size": self.spec.block_size, "dtype": self.spec.dtype, "peak_rss_mib": _peak_rss_mib()}

    # -- commands --------------------------------------------------------------------------------
    def cmd_generate(self, prompts: list[list[int]], max_tokens: int, params: list[dict[str, Any] | None],
                     timeout: float = 120.0, abort: dict[str, int] | None = None, tag: str = "r",
                     ) -> list[dict[str, Any]]:
        """Submit every prompt at once (all in flight together), step the engine until each finishes.

        Per request: ``tokens``, ``kv_transfer_params`` of the output, ``finish_reason``, and wall-clock
        ``ttft_s`` (submit -> first token) and ``e2e_s`` (submit -> finished). ``abort={"index": i,
        "after_steps": k}`` aborts request ``i`` after ``k`` engine steps (``outcome="aborted"``). A request
        not finished within ``timeout`` is aborted with ``outcome="timeout"``.
        """
        from vllm import SamplingParams

        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} kv_transfer_params")
        self._seq += 1
        recs: dict[str, dict[str, Any]] = {}
        order: list[str] = []
        t0 = time.monotonic()
        for i, (prompt, kvp) in enumerate(zip(prompts, params, strict=True)):
            rid = f"{tag}{self._seq}-{i}"
            extra = {"kv_transfer_params": dict(kvp)} if kvp is not None else None
            sp = SamplingParams(temperature=0.0, ignore_eos=True, detokenize=False, max_tokens=max_tokens,
                                extra_args=extra)
            submit = time.monotonic()
            self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
            recs[rid] = {"request_id": rid, "prompt_len": len(prompt), "tokens": [], "kv_transfer_params": None,
                         "finish_reason": None, "outcome": None, "submit": submit, "ttft_s": None, "e2e_s": None}
            order.append(rid)
        pending = set(order)
        steps = 0
        deadline = t0 + timeout
        while pending:
            if time.monotonic() > deadline:
                self.engine.abort_request(sorted(pending))
                for rid in pending:
                    recs[rid]["outcome"] = "timeout"
                break
            outs = self.engine.step()
            steps += 1
            now = time.monotonic()
            for out in outs:
                rec = recs.get(out.request_id)
                if rec is None or out.request_id not in pending:
                    continue
                comp = out.outputs[0] if out.outputs else None
                if comp is not None and comp.token_ids and rec["ttft_s"] is None:
                    rec["ttft_s"] = now - rec["submit"]
                if out.finished:
                    pending.discard(out.request_id)
                    rec["tokens"] = list(comp.token_ids) if comp is not None else []
                    rec["finish_reason"] = comp.finish_reason if comp is not None else None
                    rec["kv_transfer_params"] = out.kv_transfer_params
                    rec["e2e_s"] = now - rec["submit"]
                    rec["outcome"] = "error" if rec["finish_reason"] == "error" else "ok"
            if abort is not None and steps == abort["after_steps"]:
                rid = order[abort["index"]]
                if rid in pending:
                    self.engine.abort_request([rid])
                    pending.discard(rid)
                    recs[rid]["outcome"] = "aborted"
                    recs[rid]["e2e_s"] = now - recs[rid]["submit"]
            if not outs:
                time.sleep(_IDLE_SLEEP)
        for rec in recs.values():
            del rec["submit"]
        return [recs[rid] for rid in order]

    def cmd_blocks(self) -> dict[str, Any]:
        return {"free": int(self.pool.get_num_free_blocks()), "free_idle": self.free_idle,
                "requests": len(self.scheduler.requests)}

    def cmd_settle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Step the engine until every block is back in the pool and no request is left (or ``timeout``):
        a connector returns a finished request's blocks only through engine steps."""
        t0 = time.monotonic()
        steps = 0
        while True:
            free = int(self.pool.get_num_free_blocks())
            if (free == self.free_idle and not self.scheduler.requests) or time.monotonic() - t0 > timeout:
                break
            self.engine.step()
            steps += 1
            time.sleep(0.002)
        return {"free": free, "free_idle": self.free_idle, "requests": len(self.scheduler.requests),
                "settled": free == self.free_idle, "elapsed_s": time.monotonic() - t0, "steps": steps}

    def cmd_take_transfers(self) -> dict[str, Any]:
        """Per-load records since the last call, as the connector reports them, and what they measure."""
        conn = self._worker_connector
        if self.spec.kind == "nixl":
            xfers, self._nixl_xfers = self._nixl_xfers, []
            return {"source": "NIXL transfer telemetry (xferDuration: post -> done, one per transfer)",
                    "records": [{"request_id": None, "seconds": s, "bytes": int(b)} for s, b in xfers]}
        if conn is not None and hasattr(conn, "worker_side"):
            side = conn.worker_side
            loads = list(side.loads)
            side.loads.clear()
            return {"source": "aiotransfer WorkerSide.loads (send_metadata -> last byte landed)",
                    "records": [{"request_id": _external(r), "seconds": s, "bytes": int(b)} for r, s, b in loads]}
        return {"source": None, "records": []}

    def cmd_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"peak_rss_mib": _peak_rss_mib(), **self.cmd_blocks()}
        conn = self._worker_connector
        if conn is not None and hasattr(conn, "worker_side"):
            out["worker"] = conn.worker_side.counts()
            out["pending_requests"] = conn.worker_side.manager_stats()["pending_requests"]
            sched = getattr(self.scheduler, "connector", None)
            if sched is not None and hasattr(sched, "scheduler_side"):
                out["scheduler"] = sched.scheduler_side.counts()
        return out

    def cmd_endpoint(self) -> str | None:
        """The aiotransfer worker's control address (what a prefill's answers carry as aiotransfer_endpoint)."""
        conn = self._worker_connector
        return conn.worker_side.endpoint if conn is not None and hasattr(conn, "worker_side") else None

    def cmd_shutdown(self) -> dict[str, Any]:
        stats = self.cmd_stats()
        t0 = time.monotonic()
        self.shutdown()
        stats["shutdown_s"] = time.monotonic() - t0
        return stats

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
