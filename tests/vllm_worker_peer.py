"""A decode worker of the vLLM connector without vLLM: ``WorkerSide`` over plain buffers, one JSON command
per stdin line (for tests/test_vllm_sides.py). Blocks stand for vLLM's KV blocks, buffers for its layers."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from aiotransfer.integrations.vllm._config import ConnectorConfig
from aiotransfer.integrations.vllm._scheduler import Orders, RecvJob
from aiotransfer.integrations.vllm._worker import WorkerSide
from tests.peer import digest, make_buffers


def receive(worker: WorkerSide, kv: list[Any], cmd: dict[str, Any]) -> dict[str, Any]:
    """Start one load, then poll as vLLM's model runner does each step until the request is reported."""
    job = RecvJob(cmd["req"], cmd["room"], cmd["peer"], tuple(cmd["blocks"]))
    start = time.monotonic()
    worker.start_receives(Orders(recv=[job]))
    errors: set[int] = set()
    while time.monotonic() - start < cmd.get("bound", 60):
        _, received = worker.finished(set())
        errors |= worker.take_load_errors()
        if job.req_id in received:
            return {"finished": True, "seconds": time.monotonic() - start, "load_errors": sorted(errors),
                    "digest": digest(kv, list(job.block_ids)), "counts": worker.counts(),
                    "loaded_bytes": [b for r, _, b in worker.loads if r == job.req_id]}
        time.sleep(0.005)
    return {"finished": False, "seconds": time.monotonic() - start, "counts": worker.counts()}


def main() -> None:
    engine, pages, item_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kv = make_buffers(2, pages, item_len, None)
    worker = WorkerSide(ConnectorConfig.from_extra({"engine": engine, "transfer_timeout": 10.0}))
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
            else:
                print(json.dumps(receive(worker, kv, cmd)), flush=True)
    finally:
        worker.shutdown()


if __name__ == "__main__":
    main()
