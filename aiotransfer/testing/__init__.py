"""An in-memory engine for testing code that drives aiotransfer, without a transfer engine.

``TransferConfig(engine="memory")`` selects it: a prefill and a decode manager **in one process** move KV
pages as with Mooncake or NIXL, the bytes copied between their registered host buffers, while the test
decides when each write completes, fails, or is delayed (see docs/testing.md):

* `MemoryFabric`   -- what the memory engines of one process share; the test's handle on their writes
                             (auto mode: writes land by themselves; manual mode: the test ends each one)
* `Write`          -- one posted batch: its entries, its outcome (a `WriteOutcome`), the bytes that landed
* `MemoryEngine`   -- the engine adapter (created by ``engine="memory"``, or directly on a fabric)
* `current_fabric`  -- the fabric ``engine="memory"`` joins: the innermost ``with fabric:``, else
* `default_fabric`  -- the process-wide one

The engine answers as the real engines do (a timeout is not an end, partial failure, late landing, a
handshake that holds the engine): a scheduler tested on it meets the cases it meets in production. It
cannot connect processes: a peer in another process is refused at the handshake.
"""

from ._engine import MemoryEngine as MemoryEngine
from ._fabric import MemoryFabric as MemoryFabric
from ._fabric import Page as Page
from ._fabric import Write as Write
from ._fabric import WriteOutcome as WriteOutcome
from ._fabric import current_fabric as current_fabric
from ._fabric import default_fabric as default_fabric

__all__ = [
    # the fabric and what it records
    "MemoryFabric",
    "Page",
    "Write",
    "WriteOutcome",
    # which fabric engine="memory" joins
    "current_fabric",
    "default_fabric",
    # the engine
    "MemoryEngine",
]
