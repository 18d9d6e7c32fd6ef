"""The benchmarks of aiotransfer, run from a checkout: ``python -m benchmarks SUITE [options]``.

Not part of the installed package (the wheel ships ``aiotransfer bench``, the default figures only). One
suite per subcommand (:data:`benchmarks.cli.SUITES`):

* ``figures``    -- raw Mooncake against aiotransfer, figures (a)-(c) (what ``aiotransfer bench`` runs)
* ``full``       -- the performance suite (:mod:`benchmarks.suite`): every engine, JSON, plots, targets
* ``lifecycle``  -- abort -> ``released()`` latency (:mod:`benchmarks.lifecycle`)
* ``handshake``  -- the prefill's loop lag while a decode's Mooncake handshake hangs
  (:mod:`benchmarks.handshake`, with the hanging listener of :mod:`benchmarks.hostile`)
* ``scale``      -- one prefill and a fleet of N decodes: idle cost per peer, per-room CPU, loop lag with every
  room open, a restart storm, a registration churn (:mod:`benchmarks.scale`)
* ``streaming``  -- layer streaming's exposed transfer time (:mod:`benchmarks.streaming`)
* ``conversion`` -- page-size and layout conversion against plain staging (:mod:`benchmarks.conversion`)
* ``vllm``       -- PD through real vLLM engines (:mod:`benchmarks.vllm_pd`, harness in :mod:`benchmarks.vllm`;
  the vLLM venv's Python)
* ``sglang``     -- SGLang's own transfer layer against aiotransfer (:mod:`benchmarks.sglang`: peers, and the
  stubs the SGLang processes import; the interop venv)
* ``device``     -- KV in GPU memory (:mod:`benchmarks.device_bench`)

The suites build on the tools' shared pieces in :mod:`aiotransfer._cli` (the child-process channel, the
raw-engine drivers, the workload, the console helpers) and on the public API.
"""

from __future__ import annotations

import os

__all__ = ["ROOT"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout this folder belongs to."""
