"""A hybrid (attention + Mamba) model's prefill -> decode handoff: KV pages, Mamba state and aux, on CPU.

The model is a tiny Qwen3-Next / Jamba-shaped hybrid: 8 layers, full attention on layers 3 and 7 (paged KV),
linear attention (Mamba-style recurrent state: a conv state and an SSM state per layer) on the other 6.
Decode cannot start a request without three things from prefill:

* the attention KV cache, in pages (``send_kv``);
* the recurrent state, one slot per request per state tensor (``send_state({StateType.MAMBA: [slot]})``);
* the aux metadata: first output token and its top-k logprobs (``send_aux(slot)``).

The room concludes ``Success`` only when all three have landed, whatever order they are sent in; decode
checks every byte of all three after ``rx.done()``. The last request shows what a mismatch looks like:
decode declares a Mamba slot, prefill sends no state, and both sides fail with the same reason.

This process is the prefill; it spawns the decode (this file, ``--role decode``) and tells it about each
request on the child's stdin. Run it::

    MC_LOG_LEVEL=ERROR python examples/hybrid_model.py [--aux-path auto|engine|tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import torch

from aiotransfer import (
    KVArgs,
    KVManager,
    KVPoll,
    StateType,
    TransferConfig,
    TransferFailed,
    alloc_metadata_buffer,
)

# Mooncake logs at INFO by default; it reads MC_LOG_LEVEL when its module first loads (children inherit it).
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

# -- model geometry ------------------------------------------------------------------------------
LAYERS = 8
ATTN_LAYERS = [3, 7]
MAMBA_LAYERS = [i for i in range(LAYERS) if i not in ATTN_LAYERS]
PAGE_TOKENS, KV_HEADS, HEAD_DIM = 16, 2, 64
CONV_DIM, CONV_KERNEL = 256, 4  # conv state: (CONV_DIM, CONV_KERNEL - 1) per layer
SSM_HEADS, SSM_HEAD_DIM, SSM_STATE = 4, 32, 16  # SSM state: (heads, head_dim, d_state) per layer
TOP_K = 8
PAGES, SLOTS = 256, 16  # KV pages per buffer; request slots in the Mamba and aux pools

SCRIPT = os.path.abspath(__file__)
MARK = "@example "
REQUESTS = [  # (prompt tokens, order prefill sends things in)
    (300, ["kv", "state", "aux"]),
    (77, ["aux", "state", "kv"]),
    (1000, ["state", "kv", "aux"]),
    (40, ["kv", "no state", "aux"]),  # sends no state though decode declared a Mamba slot: both sides fail
]


class HybridCache:
    """One rank's memory: paged KV for attention layers, Mamba state slots, aux slots."""

    def __init__(self) -> None:
        # K and V for each attention layer; layer ids let aiotransfer pair buffers by layer
        self.kv = [torch.zeros(PAGES, PAGE_TOKENS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
                   for _ in ATTN_LAYERS for _kv in "KV"]
        self.conv = [torch.zeros(SLOTS, CONV_DIM, CONV_KERNEL - 1, dtype=torch.bfloat16) for _ in MAMBA_LAYERS]
        self.ssm = [torch.zeros(SLOTS, SSM_HEADS, SSM_HEAD_DIM, SSM_STATE, dtype=torch.float32) for _ in MAMBA_LAYERS]
        # aux: host buffers here; with custom_mem_pool="INTRA_NODE_NVLINK" the helper puts them on the GPU
        self.first_token = alloc_metadata_buffer(SLOTS, (1,), torch.int32)
        self.top_ids = alloc_metadata_buffer(SLOTS, (TOP_K,), torch.int32)
        self.top_logprobs = alloc_metadata_buffer(SLOTS, (TOP_K,), torch.float32)

    def kv_args(self) -> KVArgs:
        return KVArgs(
            self.kv,
            page_size=PAGE_TOKENS,
            dtype="bfloat16",
            kv_layer_ids=[layer for layer in ATTN_LAYERS for _kv in "KV"],
            aux_buffers=[self.first_token, self.top_ids, self.top_logprobs],
            state_buffers={StateType.MAMBA: [t for pair in zip(self.conv, self.ssm, strict=True) for t in pair]},
        )


def prefill_outputs(room: int, tokens: int) -> dict[str, Any]:
    """What the prefill forward pass of request ``room`` produces (deterministic: decode recomputes it)."""
    g = torch.Generator().manual_seed(room)
    n_pages = -(-tokens // PAGE_TOKENS)
    logits = torch.randn(1000, generator=g)
    top = torch.log_softmax(logits, 0).topk(TOP_K)
    return {
        "kv": [torch.randn(n_pages, PAGE_TOKENS, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
               for _ in range(2 * len(ATTN_LAYERS))],
        "conv": [torch.randn(CONV_DIM, CONV_KERNEL - 1, generator=g).to(torch.bfloat16) for _ in MAMBA_LAYERS],
        "ssm": [torch.randn(SSM_HEADS, SSM_HEAD_DIM, SSM_STATE, generator=g) for _ in MAMBA_LAYERS],
        "first_token": top.indices[:1].to(torch.int32),
        "top_ids": top.indices.to(torch.int32),
        "top_logprobs": top.values,
    }


def emit(msg: dict[str, Any]) -> None:
    print(MARK + json.dumps(msg), flush=True)


# ----------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------
async def decode_main() -> None:
    cache = HybridCache()
    cfg = TransferConfig(engine="mooncake_tcp")
    async with KVManager(cache.kv_args(), cfg) as mgr:
        emit({"ready": True})
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        next_page = 0
        while line := await reader.readline():
            job = json.loads(line)
            room, tokens = job["room"], job["tokens"]
            n_pages = -(-tokens // PAGE_TOKENS)
            pages = [(next_page + 3 * i) % PAGES for i in range(n_pages)]  # scattered destination pages
            next_page = (next_page + 1) % PAGES
            slot = aux_slot = room % SLOTS
            async with mgr.receiver(room, job["peer"]) as rx:
                await rx.send_metadata(pages, aux_index=aux_slot, state_indices={StateType.MAMBA: [slot]})
                emit({"room": room, "declared": True})
                try:
                    await rx.done(timeout=20)
                except TransferFailed as exc:
                    emit({"room": room, "status": rx.poll().name, "reason": exc.reason})
                    continue
            # Success: KV, state and aux must all be in place now
            want = prefill_outputs(room, tokens)
            idx = torch.tensor(pages)
            checks = {
                "kv": all(torch.equal(buf[idx], w) for buf, w in zip(cache.kv, want["kv"], strict=True)),
                "mamba": all(torch.equal(c[slot], w) for c, w in zip(cache.conv, want["conv"], strict=True))
                and all(torch.equal(s[slot], w) for s, w in zip(cache.ssm, want["ssm"], strict=True)),
                "aux": torch.equal(cache.first_token[aux_slot], want["first_token"])
                and torch.equal(cache.top_ids[aux_slot], want["top_ids"])
                and torch.equal(cache.top_logprobs[aux_slot], want["top_logprobs"]),
            }
            emit({"room": room, "status": rx.poll().name, "checks": checks, "aux_path": rx.aux_path,
                  "first_token": int(cache.first_token[aux_slot, 0])})


# ----------------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------------
async def prefill_main(aux_path: str) -> int:
    cache = HybridCache()
    cfg = TransferConfig(engine="mooncake_tcp", aux_path=aux_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, SCRIPT, "--role", "decode", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdout = proc.stdout

    async def from_decode() -> dict[str, Any]:
        while True:
            line = (await asyncio.wait_for(stdout.readline(), 30)).decode()
            if not line:
                raise RuntimeError("decode process exited")
            if line.startswith(MARK):
                return dict(json.loads(line[len(MARK):]))

    ok = True
    async with KVManager(cache.kv_args(), cfg) as mgr:
        await from_decode()  # ready
        print(f"prefill up: {mgr!r}, aux path {mgr.aux_path.value}")
        for room, (tokens, order) in enumerate(REQUESTS):
            out = prefill_outputs(room, tokens)
            n_pages = len(out["kv"][0])
            pages = list(range(PAGES - n_pages, PAGES))  # where our forward pass put this prompt's KV
            slot = aux_slot = (room * 5) % SLOTS
            for buf, value in zip(cache.kv, out["kv"], strict=True):
                buf[pages] = value
            for conv, ssm, conv_value, ssm_value in zip(cache.conv, cache.ssm, out["conv"], out["ssm"], strict=True):
                conv[slot], ssm[slot] = conv_value, ssm_value
            cache.first_token[aux_slot] = out["first_token"]
            cache.top_ids[aux_slot] = out["top_ids"]
            cache.top_logprobs[aux_slot] = out["top_logprobs"]

            async with mgr.sender(room) as tx:
                proc.stdin.write((json.dumps({"room": room, "tokens": tokens, "peer": mgr.endpoint}) + "\n").encode())
                await from_decode()  # decode declared its pages, aux slot and Mamba slot
                await tx.wait_ready(timeout=10)
                steps = []
                try:
                    for what in order:
                        if what == "kv":  # two chunks, as chunked prefill would produce them
                            half = n_pages // 2
                            await tx.send_kv(pages[:half], last=False)
                            await tx.send_kv(pages[half:])
                        elif what == "state":
                            await tx.send_state({StateType.MAMBA: [slot]})
                        elif what == "no state":
                            await tx.send_state({})  # kinds differ from decode's declaration: the room fails
                        else:
                            await tx.send_aux(aux_slot)
                        steps.append(f"{what} -> {tx.poll().name}")
                    await tx.done(timeout=10)
                except TransferFailed as exc:
                    steps.append(f"prefill: {exc.reason}")
            report = await from_decode()
            print(f"room {room}: {tokens} tokens ({n_pages} pages), sent {' | '.join(steps)}")
            if "checks" in report:
                checks = " ".join(f"{k} {'ok' if v else 'DIFFERS'}" for k, v in report["checks"].items())
                print(f"         decode {report['status']}: {checks}; aux via {report['aux_path']}, "
                      f"first token {report['first_token']}")
                ok &= all(report["checks"].values()) and tx.poll() is KVPoll.Success
                ok &= steps[-1].endswith("Success") and all("Success" not in step for step in steps[:-1])
            else:  # the deliberate mismatch: both sides failed, with the reason
                print(f"         decode {report['status']}: {report['reason']}")
                ok &= tx.poll() is KVPoll.Failed and report["status"] == "Failed" and "declared" in report["reason"]
        proc.stdin.close()
        ok &= await asyncio.wait_for(proc.wait(), 30) == 0
        st = mgr.stats()
        print(f"prefill stats: kv {st.get('kv_bytes_sent', 0)} B, mamba state {st.get('state_mamba_bytes_sent', 0)} B, "
              f"aux engine/tcp {st.get('aux_engine', 0)}/{st.get('aux_tcp', 0)}, rooms ok/failed "
              f"{st.get('rooms_sent_success', 0)}/{st.get('rooms_sent_failed', 0)}")
    print("all three landed before Success in every room: OK" if ok else "FAILED")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    parser.add_argument("--aux-path", choices=["auto", "engine", "tcp"], default="auto")
    ns = parser.parse_args()
    if ns.role == "decode":
        asyncio.run(decode_main())
        return 0
    return asyncio.run(prefill_main(ns.aux_path))


if __name__ == "__main__":
    sys.exit(main())
