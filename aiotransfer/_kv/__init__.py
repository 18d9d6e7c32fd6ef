"""The objects layer: one job per module, below the public face.

* :mod:`.context` -- :class:`RankContext`, what every part of one rank shares
* :mod:`.room`    -- :class:`RoomSide`, one room's status as one side sees it
* :mod:`.peers`   -- what a rank knows of its peers, and the stash of early transfer requests
* :mod:`.push`    -- planning and direct writes of KV, state and aux (prefill side)
* :mod:`.staged`  -- the staging protocol: the writer (prefill) and the grantor (decode)
* :mod:`.notify`  -- status and abort messages to the other side
* :mod:`.prefill` -- the prefill side: registrations, transfer requests, aborts from decode
* :mod:`.client`  -- the decode side's outbound half: topology, registration, requests
* :mod:`.decode`  -- the decode side's inbound half: status, checksums, aux over TCP
* :mod:`.leader`  -- the bootstrap leader of a prefill deployment

Nothing here is public; :mod:`aiotransfer._manager` puts the parts together.
"""
