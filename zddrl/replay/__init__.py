"""The replay role (`zddrl replay`): a process that takes a replay run's trajectories from the broker and serves
sampled batches to learner shards, and the learner shards' client of it.

``service.py`` is the process and its sockets, ``store.py`` its buffer, intake books and state files, ``client.py``
a learner shard's side (``RemoteReplay``). The learner imports the client, so this package sits below the roles
(``zddrl.learner``, ``zddrl.broker``) and imports neither; above the client side of the bus (``zddrl.transport``)
and the maths (``zddrl.algos``), which it uses. What it shares with the learner lives below both: the buffer's
data structures are the maths' (``zddrl.algos.replay_buffer``: the Ape-X and SAC cores sample the same buffer in
the learner placement, and their actors compute n-step TD errors with it), and the checks and counting of a
received trajectory are ``zddrl.intake``'s. The click command stays in ``zddrl/cli/replay.py``, with every other
command; the learner's collector for this placement (``learner.rounds.ServiceFeed``) stays the learner's, since it
drives the learner's poller, ledger and shard group.
"""
