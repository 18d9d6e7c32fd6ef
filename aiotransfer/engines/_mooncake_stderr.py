"""Mooncake's benign start-up lines kept off stderr while its ``initialize`` runs (see
:func:`without_benign_start_lines`)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

__all__ = ["BENIGN_START_LINES", "without_benign_start_lines"]

log = logging.getLogger("aiotransfer.engines.mooncake")

BENIGN_START_LINES = re.compile(
    rb"WARNING: Logging before InitGoogleLogging\(\) is written to STDERR\s*"
    rb"|W\d{4,8} [\d:.]+ +\d+ transfer_engine_py\.cpp:\d+\] Using default malloc/free for protocol: \w*\s*"
    rb"|E\d{4,8} [\d:.]+ +\d+ transfer_metadata\.cpp:\d+\] Local segment descriptor not found\s*"
)
"""The glog lines :func:`without_benign_start_lines` drops (any timestamp, thread id and line number)."""


@contextlib.contextmanager
def without_benign_start_lines() -> Iterator[None]:
    """While the block runs, pass file descriptor 2 through a filter that drops Mooncake's benign start-up
    lines (``BENIGN_START_LINES``); every other line is forwarded at once, in order.

    glog prints its ``Logging before InitGoogleLogging()`` notice before the first line a process logs, and
    Mooncake's Python binding logs ``Using default malloc/free`` for a protocol that needs no allocator of
    its own (TCP, for one): both say nothing about this engine. Where ``Local segment descriptor not found`` comes
    from (Mooncake 0.3.13, ``TcpTransport::install`` and ``RdmaTransport::install``):
    ``initialize`` installs a transport, whose ``allocateLocalSegmentID`` first asks the metadata layer for
    an existing descriptor of its own segment (``getSegmentDesc(local_server_name)``) so that it can add
    its protocol to it. In P2P handshake mode that lookup begins by reading the *local* segment, which
    that very call is about to create, so it logs the ERROR and returns nothing; the transport then creates
    the descriptor and everything works. It happens inside ``initialize``, before the adapter can call
    anything, so no call order on our side avoids it. The filter is active only during ``initialize``:
    the same lines at any other time (a real fault) are not touched.
    """
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to filter
        yield
        return
    read_fd, write_fd = os.pipe()
    dropped: list[bytes] = []

    def pump() -> None:
        with os.fdopen(read_fd, "rb") as lines:
            for line in lines:
                if BENIGN_START_LINES.fullmatch(line):
                    dropped.append(line)
                else:
                    with contextlib.suppress(OSError):
                        os.write(saved, line)

    thread = threading.Thread(target=pump, name="aiotransfer-mooncake-stderr", daemon=True)
    thread.start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump sees EOF
        thread.join(5.0)
        if thread.is_alive():  # a child process inherited the pipe: leave the pump its copy of stderr
            log.debug("Mooncake stderr filter still draining after initialize")
        else:
            os.close(saved)
        if dropped:
            log.debug("Mooncake logged its benign start-up lines: %s",
                      " | ".join(line.decode(errors="replace").strip() for line in dropped))
