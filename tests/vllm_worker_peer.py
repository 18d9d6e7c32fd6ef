"""A decode worker of the vLLM connector without vLLM: ``WorkerSide`` over plain buffers, one JSON command
per stdin line (for tests/test_vllm_sides.py). Blocks stand for vLLM's KV blocks, buffers for its layers."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from aiotransfer.integrations.vllm._config import ConnectorConfig
from aiotransfer.integrations.vllm._scheduler import Orders, RecvJob, SendJob
from aiotransfer.integrations.vllm._worker import WorkerSide
from tests.peer import digest, make_buffers


class TensorView:
    """The part of torch's tensor API the worker reads (vLLM hands it tensors); a view over a NumPy array."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = array.shape
        self.dtype = array.dtype

    def stride(self, dim: int) -> int:
        return int(self.array.strides[dim]) // self.array.itemsize

    def element_size(self) -> int:
        return int(self.array.itemsize)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)


def hybrid_layers(kv: list[np.ndarray]) -> tuple[dict[str, TensorView], dict[str, list[TensorView]]]:
    """vLLM's hybrid layout over ``kv`` (one region per buffer, pages along dim 0): region i holds attention
    layer i (whole pages) and Mamba layer i (two strided views inside each page: conv and SSM state)."""
    attention = {f"attn.{i}": TensorView(buf) for i, buf in enumerate(kv)}
    mamba = {f"mamba.{i}": [TensorView(buf[:, :96]), TensorView(buf[:, 128:-64])] for i, buf in enumerate(kv)}
    return attention, mamba


def receive(worker: WorkerSide, kv: list[Any], cmd: dict[str, Any]) -> dict[str, Any]:
    """Start one load, then poll as vLLM's model runner does each step until the request is reported."""
    job = RecvJob(cmd["req"], cmd["room"], cmd["peer"], tuple(cmd["blocks"]), cmd.get("state"))
    start = time.monotonic()
    worker.start_receives(Orders(recv=[job]))
    errors: set[int] = set()
    while time.monotonic() - start < cmd.get("bound", 60):
        _, received = worker.finished(set())
        errors |= worker.take_load_errors()
        if job.req_id in received:
            state = [job.state_block] if job.state_block is not None else []
            return {"finished": True, "seconds": time.monotonic() - start, "load_errors": sorted(errors),
                    "failed": sorted(worker.take_failed_receives(received)),
                    "digest": digest(kv, list(job.block_ids)), "state_digest": digest(kv, state),
                    "counts": worker.counts(),
                    "loaded_bytes": [b for r, _, b in worker.loads if r == job.req_id]}
        time.sleep(0.005)
    return {"finished": False, "seconds": time.monotonic() - start, "counts": worker.counts()}


def stream_part(worker: WorkerSide, cmd: dict[str, Any]) -> dict[str, Any]:
    """As a prefill worker: once the decode's request has arrived, begin the pass that computes the prompt
    and report its first ``layers`` layers written, then answer with the pass still under way (the test
    then kills this process mid-stream)."""
    deadline = time.monotonic() + cmd.get("bound", 20)
    while worker.manager_stats()["pending_requests"] < 1:
        if time.monotonic() > deadline:
            return {"ok": False, "why": "the decode's request never arrived"}
        time.sleep(0.01)
    worker.begin_pass(Orders(send=[SendJob(cmd["req"], cmd["room"], tuple(cmd["blocks"]))]))
    for layer in range(cmd["layers"]):
        worker.layer_written(f"layer.{layer}")
    time.sleep(cmd.get("settle", 0.3))  # the reported layers' writes land
    return {"ok": True, "counts": worker.counts()}


def main() -> None:
    engine, pages, item_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kv = make_buffers(2, pages, item_len, None)
    worker = WorkerSide(ConnectorConfig.from_extra({"engine": engine, "transfer_timeout": 10.0,
                                                    "stream_layers": "always"}))
    if sys.argv[4:] == ["hybrid"]:
        endpoint = worker.register_hybrid(*hybrid_layers(kv), block_size=16)
    else:
        endpoint = worker.register({f"layer.{i}": buf for i, buf in enumerate(kv)}, block_size=16)
    print(json.dumps({"endpoint": endpoint}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "forgo":
                worker.start_receives(Orders(forgo=[(cmd["room"], cmd["peer"])]))
                print(json.dumps({"ok": True}), flush=True)
            elif cmd["op"] == "stream":
                print(json.dumps(stream_part(worker, cmd)), flush=True)
            else:
                print(json.dumps(receive(worker, kv, cmd)), flush=True)
    finally:
        worker.shutdown()


if __name__ == "__main__":
    main()
