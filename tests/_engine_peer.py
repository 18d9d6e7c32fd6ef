"""Target process for the engine contract tests: ``python tests/_engine_peer.py <engine> [nbytes]``.

Creates the engine (through the registry), registers one zeroed buffer and prints one line
``PEER {"session_id", "info" (base64), "addr", "nbytes", "probe"}``. Then answers on stdin:

* ``crc <off> <n>``        -> ``CRC <zlib.crc32 of buf[off:off+n]>``
* ``check <off> <n> <v>``  -> ``OK`` if every byte of buf[off:off+n] equals v, else ``BAD``
* ``exit``                 -> leaves with ``os._exit(0)`` (no native teardown at interpreter exit)
"""

from __future__ import annotations

import base64
import json
import os
import sys
import zlib

import numpy as np

from aiotransfer._config import TransferConfig
from aiotransfer.engines._base import MemoryRegion
from aiotransfer.engines._registry import create_engine


def main() -> None:
    name = sys.argv[1]
    nbytes = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    engine = create_engine(TransferConfig(engine=name))
    buf = np.zeros(nbytes, dtype=np.uint8)
    engine.register([MemoryRegion(int(buf.ctypes.data), nbytes)])
    probe = engine.probe_region
    hello = {
        "session_id": engine.session_id,
        "info": base64.b64encode(engine.local_info()).decode(),
        "addr": int(buf.ctypes.data),
        "nbytes": nbytes,
        "probe": probe.ptr if probe is not None else int(buf.ctypes.data),
    }
    print("PEER " + json.dumps(hello), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "crc":
            off, n = int(args[0]), int(args[1])
            print(f"CRC {zlib.crc32(buf[off:off + n].tobytes())}", flush=True)
        elif cmd == "check":
            off, n, val = map(int, args)
            print("OK" if bool((buf[off:off + n] == val).all()) else "BAD", flush=True)
        elif cmd == "exit":
            break
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
