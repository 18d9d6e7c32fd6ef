"""``python -m benchmarks vllm``: TTFT of PD through AiotransferConnector, serial and concurrent, against
vLLM's own NixlConnector and against a single engine, in one run.

Same model (:data:`~benchmarks.vllm.model.BENCH`: 8 layers, 8 KV heads of 64, fp32, 32 KiB of KV per
token), same prompts. Each connector kind gets one prefill and one decode engine (``single``: one engine),
started once and reused: a warm-up request, then for each prompt size and concurrency ``repeats`` rounds
(all requests of a round submitted together). AiotransferConnector kinds run two flows per round, one after
the other on the same engines:

* ``serial``     -- vLLM's flow, as NixlConnector runs it: the prefill's requests, then, with what they
  answered, the decode's;
* ``concurrent`` -- concurrent dispatch: each prompt's prefill and decode requests submitted together, in
  one room (what ``examples/vllm_pd_proxy.py --concurrent`` does). The decode asks while the prefill
  computes, and the prefill pushes each layer as its forward pass writes it (kinds ending ``-whole`` run
  with ``stream_layers="never"``: the room goes whole after the pass; ``-auto``: the connector's default rule
  decides, per pass). With ``--prefill-chunk N`` the
  prefill (and the single engine) compute prompts in chunks of N tokens, and each chunk's blocks go in its
  own step (kinds ending ``-nochunks``: ``send_chunks=False``, all with the last chunk).

Per request (p50 and p99 over rounds and requests):

* ``ttft_s``        -- what a client of the router sees: serial, the prefill's submit -> finish plus the
  decode's submit -> first token; concurrent, the submit -> the decode's first token;
* ``handover_s``    -- ``ttft_s`` minus the single engine's ``ttft_s`` p50 for the same prompts (the exposed
  handover: what disaggregation adds to the first token);
* ``decode_ttft_s`` -- the decode's submit -> first token alone (concurrent: includes the prefill's compute);
* ``transfer_s``    -- the KV load as the connector reports it (aiotransfer: ``send_metadata`` -> last byte,
  which under concurrent dispatch spans the prefill's compute; NixlConnector: NIXL's telemetry, post ->
  done).

Ratios are against NixlConnector's serial flow (< 1: faster). With ``--omp-split`` (the default of
``python -m benchmarks vllm``) the prefill engine process runs on core 0 and the decode's on core 1, every thread
(the single engine: core 0), as if each had its own host: the decode engine's loop, which steps while a
request waits for its KV, then does not take the prefill's core. vLLM itself moves NIXL's worker thread to
the last core. NIXL's UCX progress thread spins under NixlConnector and the ``-spin`` kinds (NixlConnector's
way, the like-for-like comparison), while ``aiotransfer-nixl`` paces it (the connector's default). The
connector's ``transfer_timeout`` and ``lease`` are 300 s here: under concurrent dispatch the decode's wait
includes the prefill's compute, which takes tens of seconds for 8 prompts of 4k tokens on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import time
from typing import Any

from aiotransfer._cli import console
from aiotransfer._cli.files import write_json

from . import scenarios as sc
from .engine import Engine, start_engines
from .model import BENCH, make_tiny_llama

__all__ = ["DEFAULT_KINDS", "run_bench"]

DEFAULT_KINDS = "single,nixl,aiotransfer-nixl-spin,aiotransfer-nixl-spin-whole,aiotransfer-nixl"
"""The reference, NixlConnector, and AiotransferConnector with NIXL's progress thread as NixlConnector runs
it (with and without layer streaming) and as the connector runs it by default."""
_METRICS = ("ttft_s", "handover_s", "decode_ttft_s", "e2e_s", "transfer_s")
_WARMUP_TOKENS = 64


def _pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1)."""
    if not xs:
        return None
    ys = sorted(xs)
    return ys[max(0, math.ceil(q * len(ys)) - 1)]


def _check(results: list[dict[str, Any]], what: str) -> None:
    bad = [r for r in results if r["outcome"] != "ok"]
    if bad:
        raise RuntimeError(f"{what} failed: {bad[0]['outcome']} ({bad[0].get('finish_reason')})")


def _loads(p: sc.Pair, dec: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    loads = p.decode.call("take_transfers")
    by_id = {rec["request_id"]: rec for rec in loads["records"] if rec["request_id"] is not None}
    unnamed = [rec for rec in loads["records"] if rec["request_id"] is None]
    return [by_id.get(b["request_id"]) or (unnamed[i] if len(unnamed) == len(dec) else None)
            for i, b in enumerate(dec)]


def _pd_round(p: sc.Pair, prompts: list[list[int]], mode: str) -> list[dict[str, Any]]:
    streamed_before = p.prefill.call("stats").get("worker", {}).get("sends_streamed", 0)
    if mode == "concurrent":
        pre, dec = p.run_concurrent(prompts, ask_first=False)
    else:
        pre = p.run_prefill(prompts)
        _check(pre, "prefill")
        dec = p.run_decode(prompts, [r["kv_transfer_params"] for r in pre])
    _check(pre, "prefill")
    _check(dec, "decode")
    streamed = p.prefill.call("stats").get("worker", {}).get("sends_streamed", 0) - streamed_before
    rows = []
    for a, b, rec in zip(pre, dec, _loads(p, dec), strict=True):
        serial = mode == "serial"
        rows.append({"prompt_len": a["prompt_len"], "prefill_s": a["e2e_s"], "decode_ttft_s": b["ttft_s"],
                     "ttft_s": a["e2e_s"] + b["ttft_s"] if serial else b["ttft_s"],
                     "e2e_s": a["e2e_s"] + b["e2e_s"] if serial else b["e2e_s"],
                     "transfer_s": rec["seconds"] if rec else None, "streamed": streamed / len(dec)})
    p.settle()
    return rows


def _single_round(eng: Engine, prompts: list[list[int]], opts: sc.Options) -> list[dict[str, Any]]:
    res = eng.call("generate", wait=opts.step_timeout + 30, prompts=prompts, max_tokens=opts.max_tokens,
                   params=[None] * len(prompts), timeout=opts.step_timeout)
    _check(res, "single engine")
    return [{"prompt_len": r["prompt_len"], "ttft_s": r["ttft_s"], "e2e_s": r["e2e_s"]} for r in res]


def _summary(rows: list[dict[str, Any]], single_ttft: float | None) -> dict[str, Any]:
    if single_ttft is not None:
        for r in rows:
            r["handover_s"] = r["ttft_s"] - single_ttft
    out: dict[str, Any] = {"requests": len(rows)}
    for m in _METRICS:
        xs = [r[m] for r in rows if r.get(m) is not None]
        out[f"{m}_p50"] = statistics.median(xs) if xs else None
        out[f"{m}_p99"] = _pct(xs, 0.99)
    if rows and "streamed" in rows[0]:
        out["streamed_share"] = statistics.fmean(r["streamed"] for r in rows)
    return out


def _columns(kinds: list[str]) -> list[str]:
    cols = []
    for kind in kinds:
        if kind.startswith("aiotransfer"):
            cols += ([] if kind.endswith("-whole") else [f"{kind} serial"]) + [f"{kind} concurrent"]
        else:
            cols.append(kind if kind == "single" else f"{kind} serial")
    return cols


def _cells(res: dict[str, Any]) -> list[tuple[str, ...]]:
    """The table's header and rows (times in ms; ratios to NixlConnector's, serial)."""
    base = "nixl serial"
    rows: list[tuple[str, ...]] = [("prompt x in flight", "column", "TTFT p50 (p99)", "handover", "decode TTFT",
                                    "transfer", "streamed", "TTFT ratio", "dec. ratio")]

    def ms(v: float | None) -> str:
        return f"{v * 1e3:.0f}" if v is not None else "-"

    for size in res["tokens"]:
        for conc in res["concurrency"]:
            key = f"{size}x{conc}"
            cells = res["summary"].get(key, {})
            ref = cells.get(base) or {}
            for col in res["columns"]:
                s = cells.get(col)
                if s is None:
                    continue
                ratio = (f"{s['ttft_s_p50'] / ref['ttft_s_p50']:.2f}" if ref.get("ttft_s_p50") else "-")
                dratio = (f"{s['decode_ttft_s_p50'] / ref['decode_ttft_s_p50']:.2f}"
                          if ref.get("decode_ttft_s_p50") and s.get("decode_ttft_s_p50") else "-")
                share = f"{s['streamed_share']:.0%}" if "streamed_share" in s else "-"
                rows.append((f"{size} x {conc}", col, ms(s["ttft_s_p50"]) + " (" + ms(s["ttft_s_p99"]) + ")",
                             ms(s.get("handover_s_p50")), ms(s.get("decode_ttft_s_p50")),
                             ms(s.get("transfer_s_p50")), share, ratio, dratio))
    return rows


def _title(res: dict[str, Any]) -> str:
    return (f"vLLM PD bench: prompts of {res['tokens']} tokens, {res['max_tokens']} decode tokens, block "
            f"{res['block_size']}, {res['block_bytes'] * 1024 // 2**20 // res['block_size']} MiB of KV per 1k "
            f"tokens; p50 (p99) over {res['repeats']} round(s); times in ms; ratio: TTFT / NixlConnector's")


def _text(res: dict[str, Any]) -> str:
    """The table within 100 columns, for the terminal."""
    lines = [_title(res), console.table(_cells(res))]
    lines += [f"{kind}: FAILED: {err.splitlines()[0]}" for kind, err in res["errors"].items()]
    lines.append(f"wall {res['wall_s']:.0f} s")
    return console.wrap("\n".join(lines))


def _table(res: dict[str, Any]) -> str:
    """The table in Markdown (kept in the JSON, for the docs)."""
    widths = (18, 40, 16, 9, 11, 9, 8, 10, 10)
    cells = _cells(res)
    lines = [_title(res)]

    def md(row: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(row, widths, strict=True))) + " |"

    head = md(cells[0])
    lines += [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    lines += [md(r) for r in cells[1:]]
    for kind, err in res["errors"].items():
        lines.append(f"{kind}: FAILED: {err.splitlines()[0]}")
    lines.append(f"wall {res['wall_s']:.0f} s")
    return "\n".join(lines)


def run_bench(ns: argparse.Namespace, workdir: str) -> int:
    t0 = time.monotonic()
    quick = bool(ns.quick)
    sizes = [256] if quick else [int(t) for t in str(ns.tokens).split(",") if t]
    concs = [1, 4] if quick else [int(c) for c in ns.concurrency.split(",") if c]
    repeats = ns.repeats if ns.repeats is not None else (1 if quick else 3)
    kinds = [k for k in ns.kinds.split(",") if k]
    block_size = ns.block_size
    longest = max(sizes)
    spec = dataclasses.replace(BENCH, max_position_embeddings=max(2048, longest + ns.max_tokens + 64))
    block_bytes = spec.block_bytes(block_size)
    need = max(concs) * -(-(longest + ns.max_tokens) // block_size) * block_bytes
    kv_bytes = max(128 << 20, (need * 3 // 2 + (1 << 20) - 1) // (1 << 20) << 20)
    model = make_tiny_llama(os.path.join(workdir, "bench-model"), seed=ns.model_seed, spec=spec)
    opts = sc.Options(model=model, workdir=workdir, block_size=block_size,
                      max_model_len=min(spec.max_position_embeddings, longest + ns.max_tokens + block_size),
                      kv_cache_bytes=kv_bytes, max_tokens=ns.max_tokens,
                      transfer_timeout=max(ns.transfer_timeout, 300.0), lease=max(ns.lease, 300.0),
                      step_timeout=600.0, omp_split=ns.omp_split, prefill_chunk=ns.prefill_chunk)
    res: dict[str, Any] = {
        "suite": "vllm", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "model": dataclasses.asdict(spec), "dtype": "float32", "tokens": sizes, "max_tokens": ns.max_tokens,
        "block_size": block_size, "block_bytes": block_bytes, "kv_cache_bytes": kv_bytes, "concurrency": concs,
        "repeats": repeats, "workdir": workdir, "kinds": kinds, "columns": _columns(kinds), "rows": {},
        "summary": {}, "errors": {}, "start_s": {},
    }
    print(f"[vllm bench] prompts of {sizes} tokens, concurrency {concs}, {repeats} round(s), kinds {kinds}; "
          f"logs in {workdir}", file=sys.stderr)
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}  # "size x conc" -> column -> rows
    for kind in kinds:
        k0 = time.monotonic()
        try:
            _bench_kind(kind, opts, ns.seed, sizes, concs, repeats, rows)
        except Exception as exc:
            res["errors"][kind] = f"{type(exc).__name__}: {exc}"
            print(f"[vllm bench] {kind} failed: {res['errors'][kind]}", file=sys.stderr)
        res["start_s"][kind] = time.monotonic() - k0
    for key, cols in rows.items():
        single = cols.get("single")
        single_ttft = statistics.median(r["ttft_s"] for r in single) if single else None
        res["summary"][key] = {col: _summary(rs, single_ttft) for col, rs in cols.items()}
    res["rows"] = rows
    res["wall_s"] = time.monotonic() - t0
    table = _table(res)
    res["table"] = table
    print(_text(res))
    out = ns.out or "bench-results/vllm.json"  # run directly: python -m benchmarks.vllm_pd bench
    write_json(out, res)
    print(f"results: {out}")
    return 1 if res["errors"] else 0


def _bench_kind(kind: str, opts: sc.Options, seed: int, sizes: list[int], concs: list[int], repeats: int,
                rows: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Every round of one connector kind on one engine pair (or one engine), into ``rows``."""
    warm = sc.make_prompts(seed + 999, [_WARMUP_TOKENS])

    def prompts_for(size: int, conc: int, r: int) -> list[list[int]]:
        return sc.make_prompts(seed * 100_000 + size * 100 + conc * 10 + r, [size] * conc)

    if kind == "single":
        (eng,) = start_engines([sc.engine_spec(opts, "bench-single", "single", None,  # chunked as the prefill is
                                               omp_cpu=0 if opts.omp_split else None,
                                               max_num_batched_tokens=opts.prefill_chunk)])
        try:
            _single_round(eng, warm, opts)
            for size in sizes:
                for conc in concs:
                    for r in range(repeats):
                        got = _single_round(eng, prompts_for(size, conc, r), opts)
                        rows.setdefault(f"{size}x{conc}", {}).setdefault("single", []).extend(got)
        finally:
            eng.close()
        return
    modes = ["concurrent"] if kind.endswith("-whole") else ["serial"]
    if kind.startswith("aiotransfer") and not kind.endswith("-whole"):
        modes.append("concurrent")
    with sc.pair(opts, kind, f"bench-{kind}") as p:
        _pd_round(p, warm, "serial")
        for size in sizes:
            for conc in concs:
                for r in range(repeats):
                    for mode in modes:  # interleaved: the flows of one round run back to back
                        got = _pd_round(p, prompts_for(size, conc, r), mode)
                        rows.setdefault(f"{size}x{conc}", {}).setdefault(f"{kind} {mode}", []).extend(got)
                print(f"[vllm bench] {kind} {size}x{conc}: done", file=sys.stderr)
