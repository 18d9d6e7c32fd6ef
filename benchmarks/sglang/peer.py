"""SGLang 0.5.23's own Mooncake KV-transfer classes in their own OS process (the interop tests' and
``python -m benchmarks sglang``'s SGLang side).

Runs with the .interop-venv Python (scripts/interop-venv.sh), never with the project's .venv. Everything
on the transfer path is SGLang's real, unmodified code: ``MooncakeKVManager``, ``MooncakeKVSender``,
``MooncakeKVReceiver`` and ``MooncakeKVBootstrapServer`` over Mooncake's TCP transport on 127.0.0.1, with
the KV cache, aux (metadata) buffers in CPU torch tensors. Only the surroundings are ours: ServerArgs for
a tiny Llama config (no model is loaded), the runtime-context publication a scheduler process would do,
and the buffers that a real KV pool would own.

Usage:
    .interop-venv/bin/python benchmarks/sglang/peer.py --role prefill|decode --bootstrap-port N
        [--tp-size 2 --tp-rank 1] [--no-bootstrap-server] [--layers 8 --page-size 16 --heads 8
        --head-dim 128 --dtype-bytes 2 --pages 256] [--aux 64,64,2048 --aux-slots 16] [--seed N] [--aux-seed N]

Protocol (same shape as tests/peer.py, so tests/remote.py's ``RemotePeer`` and
:class:`benchmarks.sglang.PeerProcess` drive it): one JSON object per
stdin line, ``{"id": n, "op": ..., ...}``; one reply per stdout line, ``{"id": n, "ok": bool, ...}``. The
first stdout line is a hello ``{"id": 0, "ok": true, "endpoint": ...}`` sent once the manager is up
(prefill: the bootstrap address ``ip:port``; decode: its own ZMQ PULL endpoint ``ip:port``). Commands run
one at a time, in order; the blocking ones (``wait_status``, ``wait_done``) poll SGLang's synchronous
``poll()`` every 0.5 ms. Process stdout is redirected to stderr right at start-up, so nothing SGLang or
Mooncake prints can corrupt the protocol stream.

KV layout is SGLang's MHA layout: ``2 * layers`` buffers ``[K_0 .. K_{L-1}, V_0 .. V_{L-1}]``, each
``(pages, item_len)`` bytes with ``item_len = page_size * heads_per_rank * head_dim * dtype_bytes``
(``heads_per_rank = heads // tp_size``; a token slot is ``[heads_per_rank, head_dim]``). With ``--seed`` the
buffers hold the same bytes as tests/peer.py's ``make_buffers`` for that seed and geometry, and the digests
below are computed the same way, so digests compare across SGLang and aiotransfer peers.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(HERE, "stubs")
TINY_LLAMA = os.path.join(HERE, "tiny-llama")

# Protocol channel: a private copy of the original stdout; fd 1 becomes stderr for everyone else
# (Python prints, C++ libraries, Mooncake's glog).
_PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

# Environment every SGLang process of this harness needs, before sglang/mooncake are imported.
for _k, _v in {
    "MC_FORCE_TCP": "1",
    "MOONCAKE_PROTOCOL": "tcp",
    "SGLANG_HOST_IP": "127.0.0.1",
    "GLOG_minloglevel": "2",
    "MC_LOG_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(_k, _v)

if STUBS not in sys.path:
    sys.path.insert(0, STUBS)
importlib.import_module("interop_stubs").install()

import warnings  # noqa: E402

warnings.filterwarnings("ignore")  # SGLang warns about CUDA-only features at import time on CPU

import numpy as np  # noqa: E402
import torch  # noqa: E402

# SGLang, unmodified (importing it prints nothing on stdout: see the redirect above).
from sglang.srt import runtime_context  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.disaggregation.common.conn import KVTransferError  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found]  # noqa: E402
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (  # type: ignore[import-not-found]  # noqa: E402
    init_mooncake_transfer_engine,
)
from sglang.srt.runtime_context import SpawnRanks, get_parallel  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found]  # noqa: E402

POLL_NAMES = {KVPoll.Failed: "Failed", KVPoll.Bootstrapping: "Bootstrapping",
              KVPoll.WaitingForInput: "WaitingForInput", KVPoll.Transferring: "Transferring",
              KVPoll.Success: "Success"}
POLL_VALUES = {v: k for k, v in POLL_NAMES.items()}
POLL_INTERVAL = 0.0005


def make_buffers(n: int, pages: int, item_len: int, seed: int | None) -> list[torch.Tensor]:
    """CPU torch tensors of ``(pages, item_len)`` bytes; seeded like tests/peer.py's make_buffers."""
    bufs = []
    for b in range(n):
        t = torch.zeros((pages, item_len), dtype=torch.uint8)
        if seed is not None:
            rng = np.random.default_rng([seed, b])
            t.numpy()[...] = rng.integers(0, 256, size=(pages, item_len), dtype=np.uint8)
        bufs.append(t)
    return bufs


def digest(bufs: Sequence[torch.Tensor], rows: list[int]) -> str:
    """sha256 over ``buf[rows]`` of every buffer in order (the definition of tests/peer.py's digest)."""
    h = hashlib.sha256()
    idx = np.asarray(rows, dtype=np.int64)
    for buf in bufs:
        h.update(np.ascontiguousarray(buf.numpy()[idx]).tobytes())
    return h.hexdigest()


class SGLangPeer:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        if ns.heads % ns.tp_size:
            raise SystemExit(f"--heads {ns.heads} is not divisible by --tp-size {ns.tp_size}")
        self.heads_per_rank = ns.heads // ns.tp_size
        self.head_bytes = ns.head_dim * ns.dtype_bytes
        self.item_len = ns.page_size * self.heads_per_rank * self.head_bytes
        self.kv = make_buffers(2 * ns.layers, ns.pages, self.item_len, ns.seed)
        self.aux_item_lens = [int(x) for x in ns.aux.split(",")] if ns.aux else []
        aux_seed = ns.aux_seed if ns.aux_seed is not None else (None if ns.seed is None else ns.seed + 500)
        self.aux = [make_buffers(1, ns.aux_slots, n, None if aux_seed is None else aux_seed + i)[0]
                    for i, n in enumerate(self.aux_item_lens)]
        self.senders: dict[int, Any] = {}
        self.receivers: dict[int, Any] = {}
        self.reasons: dict[int, str] = {}
        self.server: Any = None
        self.mgr: Any = None

    # --- set-up -------------------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        ns = self.ns
        mode = DisaggregationMode.PREFILL if ns.role == "prefill" else DisaggregationMode.DECODE
        sa = ServerArgs(
            model_path=TINY_LLAMA,
            disaggregation_mode=ns.role,
            disaggregation_transfer_backend="mooncake",
            device="cpu",
            disaggregation_bootstrap_port=ns.bootstrap_port,
            host="127.0.0.1",
            skip_tokenizer_init=True,
            tp_size=ns.tp_size,
        )
        runtime_context.publish(sa, role="scheduler",
                                ranks=SpawnRanks(world_rank=ns.tp_rank, dp_rank=None, gpu_id=ns.tp_rank))
        get_parallel().override_permanently(pp_group=None)
        init_mooncake_transfer_engine("127.0.0.1", gpu_id=ns.tp_rank)

        if ns.role == "prefill" and ns.bootstrap_server:
            self.server = MooncakeKVBootstrapServer(host="127.0.0.1", port=ns.bootstrap_port)
            self._wait_health(f"127.0.0.1:{ns.bootstrap_port}", 30.0)

        args = KVArgs()
        args.engine_rank = ns.tp_rank
        args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        args.kv_data_lens = [t.numel() for t in self.kv]
        args.kv_item_lens = [self.item_len] * len(self.kv)
        args.kv_layer_ids = []  # what a plain MHA pool publishes (build_kv_layer_ids): positional pairing
        args.num_draft_entries = 0
        args.kv_cache_dtype_str = sa.kv_cache_dtype  # what model_runner resolves to when unset: "auto"
        args.kv_layout = None
        args.aux_data_ptrs = [t.data_ptr() for t in self.aux]
        args.aux_data_lens = [t.numel() for t in self.aux]
        args.aux_item_lens = list(self.aux_item_lens)
        # setup_state_kv_args for a plain MHA pool: no state components.
        args.state_types = []
        args.state_data_ptrs = []
        args.state_data_lens = []
        args.state_item_lens = []
        args.state_dim_per_tensor = []
        args.state_slice_outer_counts = []
        args.state_layer_ids = []
        args.state_conv_shard_groups = []
        args.is_hybrid_mla_backend = False
        args.swa_kv_cache_layout = None
        args.mla_compression_ratios = None
        args.ib_device = None
        args.gpu_id = ns.tp_rank
        args.kv_head_num = self.heads_per_rank
        args.total_kv_head_num = ns.heads
        args.page_size = ns.page_size
        args.system_dp_rank = 0
        args.rust_http_port = None
        args.pp_rank = 0
        args.prefill_start_layer = 0
        args.prefill_end_layer = ns.layers
        self.mgr = MooncakeKVManager(args, mode, sa, is_mla_backend=False)
        hello: dict[str, Any] = {
            "role": ns.role,
            "rank_endpoint": f"{self.mgr.local_ip}:{self.mgr.rank_port}",
            "session_id": self.mgr.get_session_id(),
            "item_len": self.item_len,
            "aux_item_lens": self.aux_item_lens,
        }
        hello["endpoint"] = (f"127.0.0.1:{ns.bootstrap_port}" if ns.role == "prefill"
                             else hello["rank_endpoint"])
        return hello

    @staticmethod
    def _wait_health(addr: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://{addr}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap server {addr} did not come up in {timeout}s")
            time.sleep(0.02)

    # --- helpers -------------------------------------------------------------------------------------------
    def _rooms(self) -> dict[int, Any]:
        return self.senders if self.ns.role == "prefill" else self.receivers

    def _poll(self, room: int) -> int:
        obj = self._rooms()[room]
        status = int(obj.poll())
        if status == KVPoll.Failed and room not in self.reasons:
            try:
                obj.failure_exception()
            except KVTransferError as exc:
                self.reasons[room] = exc.failure_reason
            except Exception as exc:
                self.reasons[room] = f"{type(exc).__name__}: {exc}"
        return status

    def _wait(self, rooms: list[int], done: Callable[[int], bool], timeout: float) -> dict[str, Any]:
        pending = set(rooms)
        t_done: dict[int, float] = {}
        status: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while pending:
            for room in list(pending):
                s = self._poll(room)
                status[room] = s
                if done(s) or s == KVPoll.Failed:
                    t_done[room] = time.monotonic()
                    pending.discard(room)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(POLL_INTERVAL)
        return {
            "status": {str(r): POLL_NAMES.get(status.get(r, -1), str(status.get(r))) for r in rooms},
            "t_done": {str(r): t for r, t in t_done.items()},
            "reasons": {str(r): self.reasons[r] for r in rooms if r in self.reasons},
            "timed_out": sorted(pending),
        }

    # --- common ops ------------------------------------------------------------------------------------------
    def op_info(self) -> dict[str, Any]:
        m = self.mgr
        return {"role": self.ns.role, "tp_rank": self.ns.tp_rank, "tp_size": self.ns.tp_size,
                "rank_endpoint": f"{m.local_ip}:{m.rank_port}", "session_id": m.get_session_id(),
                "item_len": self.item_len, "aux_item_lens": self.aux_item_lens,
                "attn_tp_size": m.attn_tp_size, "attn_tp_rank": m.attn_tp_rank,
                "prefill_unique_rank": m._prefill_unique_rank()}

    def op_poll(self, rooms: list[int]) -> dict[str, Any]:
        return {"status": {str(r): POLL_NAMES.get(self._poll(r), "?") for r in rooms},
                "reasons": {str(r): self.reasons[r] for r in rooms if r in self.reasons}}

    def op_wait_status(self, rooms: list[int], at_least: str = "WaitingForInput",
                       timeout: float = 30.0) -> dict[str, Any]:
        target = POLL_VALUES[at_least]
        return self._wait(rooms, lambda s: s >= target, timeout)

    def op_wait_done(self, rooms: list[int], timeout: float = 60.0) -> dict[str, Any]:
        return self._wait(rooms, lambda s: s == KVPoll.Success, timeout)

    def op_abort(self, room: int) -> None:
        self._rooms()[room].abort()

    def op_clear(self, rooms: list[int]) -> None:
        for r in rooms:
            obj = self._rooms().pop(r, None)
            if obj is not None:
                obj.clear()
            self.reasons.pop(r, None)

    def op_digest(self, pages: list[int]) -> dict[str, Any]:
        return {"digest": digest(self.kv, pages)}

    def op_aux_digest(self, slots: list[int]) -> dict[str, Any]:
        return {"digest": digest(self.aux, slots)}

    def op_head_digest(self, pages: list[int], head_start: int, num_heads: int) -> dict[str, Any]:
        """Digest of heads [head_start, head_start+num_heads) of every token slot of ``pages``, per buffer."""
        h = hashlib.sha256()
        idx = np.asarray(pages, dtype=np.int64)
        for buf in self.kv:
            view = buf.numpy().reshape(self.ns.pages, self.ns.page_size, self.heads_per_rank, self.head_bytes)
            h.update(np.ascontiguousarray(view[idx, :, head_start:head_start + num_heads, :]).tobytes())
        return {"digest": h.hexdigest()}

    def op_zero(self, pages: list[int] | None = None) -> None:
        """Zero every KV and aux buffer, or only the KV pages ``pages``."""
        if pages is not None:
            idx = torch.as_tensor(pages, dtype=torch.int64)
            for t in self.kv:
                t[idx] = 0
            return
        for t in self.kv + self.aux:
            t.zero_()

    # --- prefill ops --------------------------------------------------------------------------------------
    def op_senders(self, rooms: list[dict[str, Any]]) -> None:
        """Create a MooncakeKVSender per room and ``init(num_kv_indices, aux_index)`` it."""
        addr = f"127.0.0.1:{self.ns.bootstrap_port}"
        for spec in rooms:
            room = int(spec["room"])
            tx = MooncakeKVSender(self.mgr, addr, room)
            tx.init(int(spec["num_pages"]), spec.get("aux_index"))
            self.senders[room] = tx

    def op_send(self, rooms: list[dict[str, Any]]) -> dict[str, Any]:
        """``sender.send(chunk)`` for every chunk of every room (room by room, in order).

        Each spec: ``{"room", "pages": prefill page indices, "chunk": pages per chunk (default: all)}``;
        an empty ``pages`` list sends the single empty last chunk SGLang allows.
        """
        t_send: dict[str, float] = {}
        chunks_sent: dict[str, int] = {}
        for spec in rooms:
            room = int(spec["room"])
            pages = np.asarray(spec["pages"], dtype=np.int32)
            step = int(spec.get("chunk") or max(len(pages), 1))
            t_send[str(room)] = time.monotonic()
            n = 0
            for start in range(0, max(len(pages), 1), step):
                self.senders[room].send(pages[start:start + step])
                n += 1
            chunks_sent[str(room)] = n
        return {"t_send": t_send, "chunks": chunks_sent}

    # --- decode ops -----------------------------------------------------------------------------------------
    def op_receivers(self, bootstrap_addr: str, rooms: list[int], prefill_dp_rank: int = 0,
                     timeout: float = 30.0) -> dict[str, Any]:
        """What SGLang's decode scheduler does per request: make sure the prefill's parallel info is cached
        (``try_ensure_parallel_info``: GET /route with all -1, retried while it answers 503), then
        ``MooncakeKVReceiver(mgr, addr, room)`` and ``init(prefill_dp_rank)``."""
        deadline = time.monotonic() + timeout
        while not self.mgr.try_ensure_parallel_info(bootstrap_addr):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no parallel info from {bootstrap_addr} in {timeout}s")
            time.sleep(0.05)
        for room in rooms:
            rx = MooncakeKVReceiver(self.mgr, bootstrap_addr, room)
            rx.init(prefill_dp_rank)
            self.receivers[room] = rx
        info = self.mgr.prefill_info_table[bootstrap_addr]
        return {"status": {str(r): POLL_NAMES.get(self._poll(r), "?") for r in rooms},
                "mapping": {"prefill_attn_tp_size": info.attn_tp_size, "target_tp_ranks": info.target_tp_ranks,
                            "required_dst_info_num": info.required_dst_info_num,
                            "required_prefill_response_num": info.required_prefill_response_num}}

    def op_metadata(self, rooms: list[dict[str, Any]]) -> dict[str, Any]:
        """``receiver.send_metadata(kv_indices, aux_index)`` per room: ``{"room", "pages", "aux_index"}``."""
        t_meta: dict[str, float] = {}
        for spec in rooms:
            room = int(spec["room"])
            t_meta[str(room)] = time.monotonic()
            self.receivers[room].send_metadata(np.asarray(spec["pages"], dtype=np.int32), spec.get("aux_index"))
        return {"t_meta": t_meta}

    # --- loop -----------------------------------------------------------------------------------------------
    def reply(self, msg: dict[str, Any]) -> None:
        _PROTO.write(json.dumps(msg) + "\n")
        _PROTO.flush()

    def run(self) -> None:
        try:
            hello = self.start()
        except BaseException as exc:
            self.reply({"id": 0, "ok": False, "error": type(exc).__name__, "reason": str(exc),
                        "trace": traceback.format_exc()})
            _PROTO.flush()
            os._exit(1)
        self.reply({"id": 0, "ok": True, **hello})
        while True:
            line = sys.stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "exit":
                break
            rid = cmd.get("id")
            try:
                fn = getattr(self, "op_" + str(op))
                result = fn(**{k: v for k, v in cmd.items() if k not in ("id", "op")})
                self.reply({"id": rid, "ok": True, **(result or {})})
            except Exception as exc:
                self.reply({"id": rid, "ok": False, "error": type(exc).__name__, "reason": str(exc),
                            "trace": traceback.format_exc()})
        # SGLang's threads are daemons and Mooncake has no clean shutdown path here: leave at once.
        _PROTO.flush()
        os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--bootstrap-port", type=int, required=True,
                   help="prefill: the bootstrap server's port (rank 0 serves it); decode: unused but required")
    p.add_argument("--no-bootstrap-server", dest="bootstrap_server", action="store_false",
                   help="prefill ranks other than 0: register to rank 0's bootstrap server")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=2, help="total KV heads (across TP ranks)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--aux", default="64,64,256", help="comma-separated aux item lengths (bytes per slot)")
    p.add_argument("--aux-slots", type=int, default=16)
    p.add_argument("--seed", type=int, default=None, help="fill the KV buffers (default: zeros)")
    p.add_argument("--aux-seed", type=int, default=None, help="fill the aux buffers (default: --seed + 500)")
    SGLangPeer(p.parse_args()).run()


if __name__ == "__main__":
    main()
