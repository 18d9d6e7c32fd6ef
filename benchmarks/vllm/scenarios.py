"""PD scenarios over real vLLM engines: reference, PD, negative control, killed prefill, aborted decode.

Each scenario returns a JSON-able dict. The PD flow is vLLM's own (as its NixlConnector and a router use
it): the prefill request carries ``do_remote_decode`` and ``max_tokens=1``; its output's
``kv_transfer_params`` go unchanged into the decode request, which then runs with ``max_tokens=M``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from .engine import Engine, start_engines
from .spec import EngineSpec, free_port

__all__ = ["PREFILL_PARAMS", "Options", "Pair", "engine_spec", "decode_abort", "engine_peaks", "kill_prefill", "make_prompts", "pd", "single"]

PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""``kv_transfer_params`` of a prefill request (vLLM's PD flow)."""


@dataclass(frozen=True)
class Options:
    model: str
    workdir: str
    block_size: int | None = 32
    max_model_len: int = 1024
    kv_cache_bytes: int = 64 << 20
    max_tokens: int = 8
    transfer_timeout: float = 10.0
    lease: float = 10.0
    policy: str = "fail"
    step_timeout: float = 120.0
    """Bound on one generate command (all its requests)."""
    prefill_chunk: int | None = None
    """The prefill engine's token budget per step (chunked prefill), or ``None``: vLLM's default."""
    omp_split: bool = False
    """Run the prefill engine process (every thread, OpenMP's included) on core 0 and the decode's on core 1,
    as if each had its own host (a single engine: core 0)."""


def make_prompts(seed: int, lengths: Sequence[int], vocab: int = 1024) -> list[list[int]]:
    """Random token ids (3..vocab-1: no BOS/EOS), one prompt per length, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def engine_spec(opts: Options, name: str, kind: str, role: str | None, **over: Any) -> EngineSpec:
    spec = EngineSpec(name=name, model=opts.model, kind=kind, role=role,
                      log_path=os.path.join(opts.workdir, f"{name}.log"), block_size=opts.block_size,
                      max_model_len=opts.max_model_len, kv_cache_bytes=opts.kv_cache_bytes,
                      nixl_port=free_port(), failure_policy=opts.policy, transfer_timeout=opts.transfer_timeout,
                      lease=opts.lease)
    return replace(spec, **over)


class Pair:
    """A prefill and a decode engine of one connector kind, started together."""

    def __init__(self, opts: Options, kind: str, tag: str) -> None:
        self.opts = opts
        self.kind = kind
        omp = (0, 1) if opts.omp_split else (None, None)
        t0 = time.monotonic()
        self.prefill, self.decode = start_engines([
            engine_spec(opts, f"{tag}-prefill", kind, "prefill", omp_cpu=omp[0],
                        max_num_batched_tokens=opts.prefill_chunk),
            engine_spec(opts, f"{tag}-decode", kind, "decode", omp_cpu=omp[1]),
        ])
        self.start_s = time.monotonic() - t0
        self.closed: dict[str, Any] = {}

    def generate(self, eng: Engine, prompts: list[list[int]], max_tokens: int,
                 params: list[dict[str, Any] | None], **kw: Any) -> list[dict[str, Any]]:
        timeout = float(kw.pop("timeout", self.opts.step_timeout))
        res: list[dict[str, Any]] = eng.call("generate", wait=timeout + 30, prompts=prompts,
                                             max_tokens=max_tokens, params=params, timeout=timeout, **kw)
        return res

    def run_prefill(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        return self.generate(self.prefill, prompts, 1, [dict(PREFILL_PARAMS) for _ in prompts], tag="p")

    def run_decode(self, prompts: list[list[int]], params: list[dict[str, Any] | None], **kw: Any,
                   ) -> list[dict[str, Any]]:
        return self.generate(self.decode, prompts, self.opts.max_tokens, params, tag="d", **kw)

    def run_concurrent(self, prompts: list[list[int]], order: Sequence[int] | None = None, ask_first: bool = True,
                       before_prefill: Callable[[], None] | None = None, prefill: bool = True, late: bool = False,
                       **decode_kw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Concurrent dispatch: each prompt to the decode and the prefill at once, one random room per
        prompt. ``order``: decode request ``i`` takes the room of prefill request ``order[i]`` (the negative
        control swaps them). ``ask_first``: the prefill's requests go out once its worker holds every
        decode's request (the decode asked before the prompt was computed, deterministically); else both go
        out together. ``before_prefill()`` runs just before the prefill's requests would go out (a fault),
        and ``prefill=False`` sends none. ``late``: the decode's requests go out only once the prefill has
        answered (the decode's metadata arrives after the prefill finished: the rooms go whole, as in the
        serial flow). ``decode_kw`` go to the decode's generate. Returns (prefill, decode)."""
        from aiotransfer.integrations.vllm import concurrent_params

        endpoint = self.prefill.call("endpoint")
        pairs = [concurrent_params(endpoint, random.randrange(2**63)) for _ in prompts]
        order = list(order) if order is not None else list(range(len(prompts)))
        prefill_params: list[dict[str, Any] | None] = [{**PREFILL_PARAMS, **p} for p, _ in pairs]
        decode_params: list[dict[str, Any] | None] = [pairs[j][1] for j in order]
        prefilled: list[dict[str, Any]] = []
        if late:
            prefilled = self.generate(self.prefill, prompts, 1, prefill_params, tag="p")
            return prefilled, self.run_decode(prompts, decode_params, **decode_kw)
        with ThreadPoolExecutor(1) as pool:
            decoded = pool.submit(self.run_decode, prompts, decode_params, **decode_kw)
            deadline = time.monotonic() + self.opts.transfer_timeout
            while ask_first and not decoded.done() and time.monotonic() < deadline:
                if self.prefill.call("stats")["pending_requests"] >= len(prompts):
                    break
                time.sleep(0.01)
            if before_prefill is not None:
                before_prefill()
            if prefill:
                prefilled = self.generate(self.prefill, prompts, 1, prefill_params, tag="p")
            return prefilled, decoded.result()

    def settle(self, timeout: float | None = None) -> dict[str, Any]:
        """Both sides: step until every block is back (a delayed free needs engine steps)."""
        t = timeout if timeout is not None else self.opts.lease + self.opts.transfer_timeout + 10
        out: dict[str, Any] = {}
        for side, eng in (("prefill", self.prefill), ("decode", self.decode)):
            if eng.alive():
                out[side] = eng.call("settle", wait=t + 30, timeout=t)
        return out

    def close(self) -> dict[str, Any]:
        if not self.closed:
            self.closed = {"prefill": self.prefill.close(), "decode": self.decode.close()}
        return self.closed


@contextlib.contextmanager
def pair(opts: Options, kind: str, tag: str) -> Iterator[Pair]:
    p = Pair(opts, kind, tag)
    try:
        yield p
    except BaseException:
        p.prefill.close(timeout=5.0)
        p.decode.close(timeout=5.0)
        raise
    finally:
        p.close()


def engine_peaks(closed: dict[str, Any]) -> dict[str, float | None]:
    """Each engine's peak RSS (MiB) and how long its shutdown took, from its last stats."""
    out = {side: (stats or {}).get("peak_rss_mib") for side, stats in closed.items()}
    out.update({f"{side}_close_s": (stats or {}).get("close_s") for side, stats in closed.items()})
    return out


# ----------------------------------------------------------------------------------------------------
# scenarios
# ----------------------------------------------------------------------------------------------------
def single(opts: Options, prompts: list[list[int]], tag: str = "single") -> dict[str, Any]:
    """The reference: one engine, no connector, every prompt at once."""
    t0 = time.monotonic()
    (eng,) = start_engines([engine_spec(opts, tag, "single", None)])
    try:
        start_s = time.monotonic() - t0
        t1 = time.monotonic()
        res = eng.call("generate", wait=opts.step_timeout + 30, prompts=prompts, max_tokens=opts.max_tokens,
                       params=[None] * len(prompts), timeout=opts.step_timeout)
        gen_s = time.monotonic() - t1
    finally:
        closed = eng.close()
    return {"tokens": [r["tokens"] for r in res], "results": res, "start_s": start_s, "generate_s": gen_s,
            "peak_rss_mib": (closed or {}).get("peak_rss_mib"), "wall_s": time.monotonic() - t0}


def _negative(p: Pair, prompts: list[list[int]], dispatch: str = "serial") -> dict[str, Any]:
    """Two prompts of one length, their prefill outputs' params (concurrent: their rooms) swapped on the
    decode."""
    a, b = prompts
    if len(a) != len(b):
        raise ValueError("the negative control needs two prompts of the same length")
    if dispatch == "concurrent":
        _, dec = p.run_concurrent([a, b], order=[1, 0])
    else:
        pre = p.run_prefill([a, b])
        swapped = [pre[1]["kv_transfer_params"], pre[0]["kv_transfer_params"]]
        dec = p.run_decode([a, b], swapped)
    return {"tokens": [r["tokens"] for r in dec], "outcomes": [r["outcome"] for r in dec]}


def pd(opts: Options, kinds: Sequence[str], prompts: list[list[int]], negative: list[list[int]] | None,
       reference: bool = True, dispatch: Sequence[str] = ("serial",)) -> dict[str, Any]:
    """Reference (single engine) once, then per kind: PD of all prompts in flight together, the negative
    control, and a leak check (every block back on both sides). With ``concurrent`` in ``dispatch``,
    AiotransferConnector kinds also run the prompts and the negative control with concurrent dispatch
    (:meth:`Pair.run_concurrent`), under ``run["concurrent"]``."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"prompt_lens": [len(x) for x in prompts], "runs": {}}
    if negative is not None:
        out["negative_prompt_lens"] = [len(x) for x in negative]
    if reference:
        out["reference"] = single(opts, prompts + (negative or []))
    for kind in kinds:
        run: dict[str, Any] = {}
        out["runs"][kind] = run
        k0 = time.monotonic()
        try:
            with pair(opts, kind, kind) as p:
                run["start_s"] = p.start_s
                run["idle_blocks"] = {"prefill": p.prefill.info["free_idle"], "decode": p.decode.info["free_idle"]}
                if prompts:
                    t = time.monotonic()
                    pre = p.run_prefill(prompts)
                    run["prefill_s"] = time.monotonic() - t
                    run["prefill"] = pre
                    t = time.monotonic()
                    dec = p.run_decode(prompts, [r["kv_transfer_params"] for r in pre])
                    run["decode_s"] = time.monotonic() - t
                    run["decode"] = dec
                    run["tokens"] = [r["tokens"] for r in dec]
                    run["transfers"] = p.decode.call("take_transfers")
                if negative is not None:
                    run["negative"] = _negative(p, negative)
                if "concurrent" in dispatch and kind.startswith("aiotransfer"):
                    run["concurrent"] = _concurrent(p, prompts, negative)
                run["settle"] = p.settle()
                run["stats"] = {"prefill": p.prefill.call("stats"), "decode": p.decode.call("stats")}
                run["peak_rss_mib"] = engine_peaks(p.close())
        except Exception as exc:  # one kind failing must not hide the others' results
            run["error"] = f"{type(exc).__name__}: {exc}"
        run["wall_s"] = time.monotonic() - k0
    out["wall_s"] = time.monotonic() - t0
    return out


def _concurrent(p: Pair, prompts: list[list[int]], negative: list[list[int]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if prompts:
        p.decode.call("take_transfers")  # the serial runs' records
        t = time.monotonic()
        pre, dec = p.run_concurrent(prompts)
        out.update(s=time.monotonic() - t, prefill=pre, decode=dec, tokens=[r["tokens"] for r in dec],
                   transfers=p.decode.call("take_transfers"))
        _, late = p.run_concurrent(prompts, late=True)
        out["late"] = {"decode": late, "tokens": [r["tokens"] for r in late]}
    if negative is not None:
        out["negative"] = _negative(p, negative, "concurrent")
    return out


def kill_prefill(opts: Options, kind: str, prompts: list[list[int]], dispatch: str = "serial") -> dict[str, Any]:
    """The prefill process group is SIGKILLed after its outputs (params) and before the decode runs; with
    concurrent dispatch, after the decode has asked for every prompt and before the prefill computes any.

    Reports the decode's outcome per request, how long the decode took, its free blocks before, after the
    requests and after settling, and (policy ``recompute``) the decode engine's own local tokens for the
    same prompts, computed afterwards, as the reference."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"kind": kind, "policy": opts.policy, "prompt_lens": [len(x) for x in prompts],
                           "dispatch": dispatch}
    with pair(opts, kind, f"{kind}-kill-{opts.policy}") as p:
        out["start_s"] = p.start_s

        def kill() -> None:
            p.prefill.kill(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while p.prefill.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            out["prefill_dead"] = not p.prefill.alive()

        out["blocks_before"] = p.decode.call("blocks")
        t = time.monotonic()
        if dispatch == "concurrent":
            _, dec = p.run_concurrent(prompts, before_prefill=kill, prefill=False, timeout=opts.transfer_timeout + 60)
        else:
            pre = p.run_prefill(prompts)
            params = [r["kv_transfer_params"] for r in pre]
            out["blocks_before"] = p.decode.call("blocks")
            kill()
            t = time.monotonic()
            dec = p.run_decode(prompts, params, timeout=opts.transfer_timeout + 60)
        out["decode_s"] = time.monotonic() - t
        out["decode"] = dec
        out["outcomes"] = [r["outcome"] for r in dec]
        out["finish_reasons"] = [r["finish_reason"] for r in dec]
        out["tokens"] = [r["tokens"] for r in dec]
        out["blocks_after_requests"] = p.decode.call("blocks")
        out["settle"] = p.decode.call("settle", wait=opts.transfer_timeout + 60,
                                      timeout=opts.transfer_timeout + 30)
        out["decode_stats"] = p.decode.call("stats")
        local = p.generate(p.decode, prompts, opts.max_tokens, [None] * len(prompts), tag="local")
        out["local_tokens"] = [r["tokens"] for r in local]
        out["blocks_after"] = p.decode.call("blocks")
        out["peak_rss_mib"] = engine_peaks(p.close())
    out["wall_s"] = time.monotonic() - t0
    return out


def decode_abort(opts: Options, kind: str, prompts: list[list[int]], after_steps: int = 1,
                 dispatch: str = "serial") -> dict[str, Any]:
    """The decode aborts request 0 after ``after_steps`` engine steps (its KV load under way; with
    concurrent dispatch, while the prefill computes or pushes it); the others run. Then both sides settle:
    every block must be back (the prefill's after its lease at the latest)."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"kind": kind, "prompt_lens": [len(x) for x in prompts], "after_steps": after_steps,
                           "dispatch": dispatch}
    abort = {"index": 0, "after_steps": after_steps}
    with pair(opts, kind, f"{kind}-abort") as p:
        out["start_s"] = p.start_s
        out["idle_blocks"] = {"prefill": p.prefill.info["free_idle"], "decode": p.decode.info["free_idle"]}
        t = time.monotonic()
        if dispatch == "concurrent":  # both at once: the abort comes while the prefill computes or pushes
            _, dec = p.run_concurrent(prompts, ask_first=False, abort=abort)
            prefilled = time.monotonic()
        else:
            pre = p.run_prefill(prompts)
            prefilled = time.monotonic()
            out["prefill_blocks_held"] = p.prefill.call("blocks")
            t = time.monotonic()
            dec = p.run_decode(prompts, [r["kv_transfer_params"] for r in pre], abort=abort)
        out["decode_s"] = time.monotonic() - t
        out["prefill_blocks_after_decode"] = p.prefill.call("blocks")
        out["outcomes"] = [r["outcome"] for r in dec]
        out["tokens"] = [r["tokens"] for r in dec]
        out["decode_stats_before_settle"] = p.decode.call("stats")
        out["settle"] = p.settle()
        out["prefill_free_after_s"] = (time.monotonic() - prefilled - out["settle"]["decode"]["elapsed_s"]
                                       if out["settle"]["prefill"]["settled"] else None)
        out["stats"] = {"prefill": p.prefill.call("stats"), "decode": p.decode.call("stats")}
        local = p.generate(p.decode, prompts, opts.max_tokens, [None] * len(prompts), tag="local")
        out["local_tokens"] = [r["tokens"] for r in local]
        out["peak_rss_mib"] = engine_peaks(p.close())
    out["wall_s"] = time.monotonic() - t0
    return out
