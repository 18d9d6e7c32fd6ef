"""``aiotransfer bench --suite vllm``: PD through AiotransferConnector against vLLM's own NixlConnector.

Same model (:data:`~aiotransfer._cli.vllm.model.BENCH`: 8 layers, 8 KV heads of 64, fp32, 32 KiB of KV per
token), same prompts, same flow. Each connector kind gets one prefill and one decode engine, started once
and reused for every round: a warm-up request, then ``repeats`` rounds at each concurrency (all requests of
a round submitted together, prefill first, then decode). Per request (medians over rounds and requests):

* ``ttft_s``        -- prefill's submit -> finish, plus the decode's submit -> first token (what a client of
  a router that waits for the prefill sees);
* ``e2e_s``         -- prefill's submit -> finish, plus the decode's submit -> last token;
* ``decode_ttft_s`` -- the decode's submit -> first token alone: scheduling, the KV load and one step;
* ``transfer_s``    -- the KV load as the connector reports it (aiotransfer: ``send_metadata`` -> last byte;
  NixlConnector: NIXL's transfer telemetry, post -> done). The scopes differ: NIXL's excludes its
  handshake and notifications, so ``decode_ttft_s`` is the like-for-like comparison;
* ``bytes``         -- KV blocks moved x block bytes.

Ratios are aiotransfer / NixlConnector (< 1: aiotransfer faster). Engines here share 2 CPU cores. NIXL's
UCX progress thread spins a core per engine under NixlConnector and ``aiotransfer-nixl-spin``;
``aiotransfer-nixl`` runs the connector's default, which paces it. Absolute numbers are this machine's, the
ratios are from the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any

from ..files import write_json
from . import scenarios as sc
from .model import BENCH, make_tiny_llama

__all__ = ["run_bench"]

_METRICS = ("ttft_s", "e2e_s", "decode_ttft_s", "transfer_s")
_WARMUP_TOKENS = 64


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _round(p: sc.Pair, prompts: list[list[int]], block_bytes: int, block_size: int) -> list[dict[str, Any]]:
    pre = p.run_prefill(prompts)
    bad = [r for r in pre if r["outcome"] != "ok"]
    if bad:
        raise RuntimeError(f"prefill failed: {bad[0]}")
    dec = p.run_decode(prompts, [r["kv_transfer_params"] for r in pre])
    bad = [r for r in dec if r["outcome"] != "ok"]
    if bad:
        raise RuntimeError(f"decode failed: {bad[0]['outcome']} ({bad[0]['finish_reason']})")
    loads = p.decode.call("take_transfers")
    by_id = {rec["request_id"]: rec for rec in loads["records"] if rec["request_id"] is not None}
    unnamed = [rec for rec in loads["records"] if rec["request_id"] is None]
    rows = []
    for i, (a, b) in enumerate(zip(pre, dec, strict=True)):
        rec = by_id.get(b["request_id"]) or (unnamed[i] if len(unnamed) == len(dec) else None)
        blocks = -(-len(prompts[i]) // block_size)
        rows.append({
            "prompt_len": len(prompts[i]),
            "prefill_s": a["e2e_s"],
            "decode_ttft_s": b["ttft_s"],
            "decode_e2e_s": b["e2e_s"],
            "ttft_s": a["e2e_s"] + b["ttft_s"],
            "e2e_s": a["e2e_s"] + b["e2e_s"],
            "transfer_s": rec["seconds"] if rec else None,
            "bytes_reported": rec["bytes"] if rec else None,
            "bytes": blocks * block_bytes,
        })
    p.settle()
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(rows)}
    for m in _METRICS:
        out[f"{m}_p50"] = _median([r[m] for r in rows if r[m] is not None])
    out["bytes_per_request"] = _median([r["bytes"] for r in rows])
    t, b = out["transfer_s_p50"], out["bytes_per_request"]
    out["transfer_gbps"] = b / t / 1e9 if t and b else None
    return out


def _table(res: dict[str, Any]) -> str:
    kinds = list(res["kinds"])
    base = "nixl" if "nixl" in kinds else None
    lines = [f"vLLM PD bench: {res['tokens']}-token prompts, {res['max_tokens']} decode tokens, block "
             f"{res['block_size']}, {res['bytes_per_request'] / 2**20:.1f} MiB of KV per request; "
             f"p50 over {res['repeats']} round(s)"]
    head = f"{'conc':>4} {'metric':<15}" + "".join(f"{k:>22}" for k in kinds)
    if base:
        head += "".join(f"{k + '/nixl':>28}" for k in kinds if k != base)
    lines.append(head)
    for conc in res["concurrency"]:
        for m in (*_METRICS, "transfer_gbps"):
            key = m if m == "transfer_gbps" else f"{m}_p50"
            vals = {k: (res["kinds"][k].get("summary", {}).get(str(conc)) or {}).get(key) for k in kinds}
            unit = 1.0 if m == "transfer_gbps" else 1e3
            row = f"{conc:>4} {m.replace('_s', '_ms') if m != 'transfer_gbps' else 'GB/s':<15}"
            row += "".join(f"{v * unit:>22.2f}" if v is not None else f"{'-':>22}" for v in vals.values())
            if base:
                for k in kinds:
                    if k == base:
                        continue
                    a, b = vals[k], vals[base]
                    row += f"{a / b:>28.2f}" if a is not None and b else f"{'-':>28}"
            lines.append(row)
    for k in kinds:
        err = res["kinds"][k].get("error")
        if err:
            lines.append(f"{k}: FAILED: {err.splitlines()[0]}")
    lines.append("transfer_s sources: " + "; ".join(
        f"{k}: {res['kinds'][k].get('transfer_source')}" for k in kinds))
    lines.append("nixl and aiotransfer-nixl-spin: NIXL's UCX progress thread spins a core per engine on this 2-core "
                 "machine, and their rows vary by several x between rounds; aiotransfer-nixl paces it (the "
                 "connector's default) and Mooncake TCP has no spinning thread")
    lines.append(f"wall {res['wall_s']:.0f} s")
    return "\n".join(lines)


def run_bench(ns: argparse.Namespace, workdir: str) -> int:
    t0 = time.monotonic()
    quick = bool(ns.quick)
    tokens = 256 if quick else ns.tokens
    concs = [1, 4] if quick else [int(c) for c in ns.concurrency.split(",") if c]
    repeats = ns.repeats if ns.repeats is not None else (1 if quick else 3)
    kinds = [k for k in ns.kinds.split(",") if k]
    block_size = ns.block_size
    spec = dataclasses.replace(BENCH, max_position_embeddings=max(2048, tokens + ns.max_tokens + 64))
    block_bytes = spec.block_bytes(block_size)
    need = max(concs) * -(-(tokens + ns.max_tokens) // block_size) * block_bytes
    kv_bytes = max(128 << 20, (need * 3 // 2 + (1 << 20) - 1) // (1 << 20) << 20)
    model = make_tiny_llama(os.path.join(workdir, "bench-model"), seed=ns.model_seed, spec=spec)
    opts = sc.Options(model=model, workdir=workdir, block_size=block_size,
                      max_model_len=min(spec.max_position_embeddings, tokens + ns.max_tokens + block_size),
                      kv_cache_bytes=kv_bytes, max_tokens=ns.max_tokens,
                      transfer_timeout=max(ns.transfer_timeout, 30.0), lease=max(ns.lease, 30.0),
                      omp_split=ns.omp_split)
    res: dict[str, Any] = {
        "suite": "vllm", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "model": dataclasses.asdict(spec), "dtype": "float32", "tokens": tokens, "max_tokens": ns.max_tokens,
        "block_size": block_size, "block_bytes": block_bytes,
        "bytes_per_request": -(-tokens // block_size) * block_bytes, "kv_cache_bytes": kv_bytes,
        "concurrency": concs, "repeats": repeats, "workdir": workdir, "kinds": {},
    }
    print(f"[vllm bench] {tokens}-token prompts, concurrency {concs}, {repeats} round(s), kinds {kinds}; "
          f"logs in {workdir}", file=sys.stderr)
    for kind in kinds:
        entry: dict[str, Any] = {"rounds": {}, "summary": {}}
        res["kinds"][kind] = entry
        k0 = time.monotonic()
        try:
            with sc.pair(opts, kind, f"bench-{kind}") as p:
                entry["start_s"] = p.start_s
                warm = sc.make_prompts(ns.seed + 999, [_WARMUP_TOKENS])
                _round(p, warm, block_bytes, block_size)
                for conc in concs:
                    rows: list[dict[str, Any]] = []
                    for r in range(repeats):
                        prompts = sc.make_prompts(ns.seed * 1000 + conc * 10 + r, [tokens] * conc)
                        rows += _round(p, prompts, block_bytes, block_size)
                    entry["rounds"][str(conc)] = rows
                    entry["summary"][str(conc)] = _summary(rows)
                    print(f"[vllm bench] {kind} x{conc}: {entry['summary'][str(conc)]}", file=sys.stderr)
                entry["transfer_source"] = p.decode.call("take_transfers")["source"]
                entry["peak_rss_mib"] = sc.engine_peaks(p.close())
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[vllm bench] {kind} failed: {entry['error']}", file=sys.stderr)
        entry["wall_s"] = time.monotonic() - k0
    res["wall_s"] = time.monotonic() - t0
    table = _table(res)
    res["table"] = table
    print(table)
    out = ns.out or "bench-results/vllm.json"
    write_json(out, res)
    print(f"results: {out}")
    return 1 if any("error" in e for e in res["kinds"].values()) else 0
