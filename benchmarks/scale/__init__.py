"""``python -m benchmarks scale``: one prefill manager and a fleet of N decode managers.

The prefill is this process (Mooncake over TCP, the real control plane on 127.0.0.1); the decodes are spread
over ``--processes`` worker processes (:mod:`.decode`), each hosting many managers on one event loop over
one shared native Mooncake engine. At each level of N (``--peers``):

* idle: the prefill's process CPU and its loop thread's CPU per second, RSS, descriptors and threads, with
  every decode registered and no room open (per peer: the slopes over the levels);
* per-room CPU: rounds of one 4 KiB room per decode until ``--min-rooms``; the prefill loop thread's CPU
  over the rounds per room;
* held rooms: every decode opens one room and the prefill holds them all ``--hold`` seconds (heartbeats to
  every peer) before sending them: its loop's lag (1 ms probe: p50, p99, max) and loop CPU; rooms failed.

Then a restart storm: every decode holds a room, half of the processes are killed and as many started,
whose decodes open a room as soon as they are up; the prefill sends every held room. Rooms on killed decodes
must fail (how soon after their processes are gone), the others succeed, the new decodes' first rooms
succeed (how soon after they were up), and the loop's lag. Last, a registration churn on a fresh prefill:
``--churn`` decodes on new endpoints, at most ``--churn-alive`` alive at once, each one room and gone:
how many were accepted, and the registrations the prefill held (``stats()``).

Modules: :mod:`.run` (the entry point), :mod:`.phases` (the measurements), :mod:`.fleet` (the decode
processes, from the prefill's side), :mod:`.decode` (a decode process), :mod:`.report` (figures, targets,
table), :mod:`.common`.
"""
