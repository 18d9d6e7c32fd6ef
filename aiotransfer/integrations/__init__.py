"""Integrations: aiotransfer inside hosts that are not asyncio programs.

* :class:`BackgroundManager` -- a :class:`~aiotransfer.KVManager` on an event loop in a background thread,
  for synchronous callers (a serving engine's worker, a sync scheduler): thread-safe calls, every wait
  bounded, a clean shutdown that drains and deregisters.

Integrations use the public API only.
"""

from __future__ import annotations

from ._sync import BackgroundManager as BackgroundManager

__all__ = ["BackgroundManager"]
