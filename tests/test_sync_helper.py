"""BackgroundManager: aiotransfer driven from synchronous code, on both sides of a real transfer across two
OS processes (a real engine), with bounded waits and a clean shutdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from aiotransfer import ClosedError, KVArgs, KVPoll, TransferConfig, TransferTimeout
from aiotransfer.integrations import BackgroundManager
from tests.conftest import ENGINES
from tests.peer import digest, make_buffers

PAGES, ITEM = 256, 4096
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SyncDecode:
    def __init__(self, engine: str) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   MC_LOG_LEVEL="ERROR")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.sync_peer", engine, str(PAGES), str(ITEM)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.endpoint = self.recv()["endpoint"]

    def recv(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "sync decode exited"
        return json.loads(line)

    def send(self, **cmd: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.send(op="exit")
            self.proc.wait(20)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_two_synchronous_processes_move_a_room_byte_exact(engine: str) -> None:
    kv = make_buffers(2, PAGES, ITEM, seed=3)
    decode = SyncDecode(engine)
    try:
        with BackgroundManager(KVArgs(kv, page_size=16, dtype="uint8"), TransferConfig(engine=engine)) as bg:
            src, dst = list(range(10, 50)), [int(x) for x in np.random.default_rng(1).permutation(PAGES)[:40]]
            tx = bg.call(lambda m: m.sender(1))
            decode.send(op="receive", room=1, peer=bg.call(lambda m: m.endpoint), pages=dst)
            bg.run(lambda m: tx.wait_ready(timeout=10), timeout=15)
            sent = bg.submit(lambda m: tx.send_kv(src))  # concurrent.futures.Future
            sent.result(timeout=20)
            assert tx.poll() is KVPoll.Success  # poll() from this thread
            got = decode.recv()
            assert got["status"] == "Success" and got["digest"] == digest(kv, src)
            assert got["released"] == "success"
            bg.run(lambda m: tx.released(timeout=5), timeout=10)
            assert bg.call(lambda m: m.stats()["rooms_sent_success"]) == 1
    finally:
        decode.close()


def test_waits_are_bounded_and_close_drains_and_stops_the_thread() -> None:
    kv = make_buffers(2, PAGES, ITEM, seed=4)
    bg = BackgroundManager(KVArgs(kv, page_size=16, dtype="uint8"), TransferConfig(engine="mooncake_tcp"))
    bg.start()
    tx = bg.call(lambda m: m.sender(2))
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):  # nobody sends metadata: the call gives up, cancelled on the loop
        bg.run(lambda m: tx.wait_ready(timeout=60), timeout=0.3)
    assert time.monotonic() - t0 < 10.0  # the call's 0.3 s, not wait_ready's 60 s
    slow = bg.submit(lambda m: tx.wait_ready(timeout=60))  # still pending when we close
    threads = {t.name for t in threading.enumerate()}
    assert "aiotransfer-loop" in threads
    t0 = time.monotonic()
    bg.close(timeout=0.5)
    assert time.monotonic() - t0 < 10.0
    assert slow.cancelled() or slow.done()
    assert "aiotransfer-loop" not in {t.name for t in threading.enumerate()}
    with pytest.raises(ClosedError):
        bg.call(lambda m: m.stats())
    bg.close()  # idempotent
