"""What a consumer of a run's trajectory stream (a learner shard, a replay service) does with a trajectory before
it trusts it: bounds on its header and shapes (``admit``), the record the shards exchange of it (``records``),
episode returns read from its verified arrays (``episodes``), and how many to ask for at once (``window``).

The learner and the replay service (``zddrl.replay``) both import these, so they sit below both, just above the
config and the wire: they read ``zddrl.config`` and ``zddrl.protocol`` and nothing else of zddrl, and no socket.
"""
