"""``python -m benchmarks full``: the performance suite, with its targets, plus the figures of send_aux by
path, TP 4->2 head slicing and the engines side by side, in one command and one run.

Process layout. The orchestrator (the CLI process) imports no engine. For each engine configuration
(``mooncake_tcp``, ``nixl_shm``, ``nixl_tcp``) it spawns a *prefill worker*
(``python -m benchmarks.suite.worker --role prefill``) with that configuration's environment
(``UCX_TLS`` must be set before a NIXL agent exists, so each configuration gets its own pair of
processes), and the prefill worker spawns its *decode worker* (``--role decode``), a command server
driven over JSON lines.

Every phase builds fresh managers on both sides over its own buffers. *Raw* numbers call the prefill
manager's own native engine (``mgr.engine.raw()``: Mooncake's ``TransferEngine`` or NIXL's
``nixl_agent``; the drivers are in :mod:`aiotransfer._cli.raw`) on a plain thread, writing into the
decode manager's registered memory: raw and aiotransfer share the engine, the memory and the
connection, and their repetitions alternate. The ceilings (a NumPy copy of the same bytes; Python
``sendall``/``recv_into`` between the two worker processes over loopback TCP, 8-byte header + 1-byte ack)
are measured by the first pair, in the same run. Bytes are verified on the decode side after the
warm-up of every variant (and after the timed runs where cheap); a mismatch fails the phase.

Phases (per engine configuration; see ``ENGINES`` for which run where):

* ``ceilings``: memcpy and loopback-TCP time per size, TCP 4 KiB round trip.
* ``throughput``: one contiguous request per size; raw single entry vs ``send_kv``.
* ``scattered``: N x 4 KiB pages scattered at random on both sides; raw page by page (batches of
  <= 1,024 entries), raw one contiguous write of the same bytes, ``send_kv`` (staging auto), and the
  planning time (``KVManager.plan_transfer`` on that input, forced direct and deciding as ``send_kv``
  would, and the gather copy).
* ``lag``: 1 ms sleep probe on the prefill loop, idle, while ``send_kv`` keeps the engine saturated
  (many contiguous requests in flight), and while the raw engine does the same on a thread.
* ``concurrency``: 1..256 requests in flight; aggregate throughput, latency and CPU per request, raw and
  aiotransfer.
* ``e2e``: 4 KiB ``send_kv`` through ``done()`` on both sides; timestamps from ``time.monotonic``
  (``CLOCK_MONOTONIC``: one clock for every process on Linux, checked in the run).
* ``floor``: a small room (4 KiB, 64 KiB, 1 MiB) from the decode's ``send_metadata`` to its ``done()``
  against its floor, one ZeroMQ round trip between two control planes plus one raw write, all in the
  same two processes; the room's stages from :mod:`aiotransfer._trace` marks in both processes, and thread
  wake-ups per room (:mod:`~benchmarks.suite.floor`, tables in :mod:`~benchmarks.suite.floor_report`).
* ``aux``: ``send_aux`` latency by path (``aux_path="engine"`` vs ``"tcp"``).
* ``tp``: a Llama-8B-shaped request moved from prefill TP 4 (4 managers in the prefill worker: one
  Mooncake engine per process is shared) to decode TP 2 (2 managers in the decode worker), head-sliced,
  ``staging="never"`` (one entry per token per layer buffer per head slice) vs ``staging="always"``.
* ``cpu`` (only when named in ``--phases``): the library's CPU time per call on the prefill side (the loop
  thread, the engine's driver and the offload threads) for ``send_kv`` of 1, 64 and 4,096 scattered pages
  over 64 buffers and one ``send_layers`` call, against the raw engine's CPU time for the same entries,
  and a profiled call's breakdown (:mod:`~benchmarks.suite.cpu`, tables in
  :mod:`~benchmarks.suite.cpu_report`).

The orchestrator merges the results, evaluates the targets and draws the plots
(:mod:`benchmarks.suite.report`).

Modules: :mod:`~benchmarks.suite.common` (engine configurations, parameters, statistics, byte
patterns), :mod:`~benchmarks.suite.ceilings`, :mod:`~benchmarks.suite.decode` (the decode
worker), :mod:`~benchmarks.suite.context` (what the phases share on the prefill side), the phases
(:mod:`~benchmarks.suite.bulk`, :mod:`~benchmarks.suite.latency`,
:mod:`~benchmarks.suite.floor`, :mod:`~benchmarks.suite.tp`, :mod:`~benchmarks.suite.cpu` with
:mod:`~benchmarks.suite.cpu_profile`),
:mod:`~benchmarks.suite.worker` (the workers' entry point), :mod:`~benchmarks.suite.run` (the
orchestrator), :mod:`~benchmarks.suite.report`, :mod:`~benchmarks.suite.floor_report` and
:mod:`~benchmarks.suite.cpu_report`.
"""
