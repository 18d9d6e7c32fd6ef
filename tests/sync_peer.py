"""A decode process written as synchronous code: a BackgroundManager driven from plain Python, answering
one JSON command per stdin line (for tests/test_sync_helper.py)."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from aiotransfer import KVArgs, TransferConfig
from aiotransfer.integrations import BackgroundManager
from tests.peer import digest, make_buffers


def receive(bg: BackgroundManager, kv: list[np.ndarray], room: int, peer: str, pages: list[int]) -> dict[str, Any]:
    rx = bg.call(lambda m: m.receiver(room, peer))
    bg.run(lambda m: rx.send_metadata(pages, timeout=10), timeout=15)
    out: dict[str, Any]
    try:
        bg.run(lambda m: rx.done(timeout=20), timeout=25)
        out = {"status": rx.poll().name, "digest": digest(kv, pages)}
    except Exception as exc:
        out = {"status": rx.poll().name, "error": type(exc).__name__, "reason": str(exc)}
    bg.run(lambda m: rx.released(timeout=30), timeout=35)
    out["released"] = rx.release_cause
    return out


def main() -> None:
    engine, pages, item_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kv = make_buffers(2, pages, item_len, None)
    with BackgroundManager(KVArgs(kv, page_size=16, dtype="uint8"), TransferConfig(engine=engine)) as bg:
        print(json.dumps({"endpoint": bg.call(lambda m: m.endpoint)}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            print(json.dumps(receive(bg, kv, cmd["room"], cmd["peer"], cmd["pages"])), flush=True)


if __name__ == "__main__":
    main()
