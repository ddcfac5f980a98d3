"""Prioritized experience replay as data structures, numpy only: the ring buffer (``prioritized``), its sum-tree
(``sumtree``), n-step returns (``nstep``), a rollout's block in the ring (``block``) and the memory check
(``memory``).

They sit in the learning layer because the maths uses them: the Ape-X and SAC cores sample a ``PrioritizedReplay``
in the learner placement (``algos.replay_learner``), Ape-X's actors compute their TD errors with
``nstep`` (zddrl/algos/apex/policy.py), and ``algos.checks`` sizes the buffer before a run starts. The replay service
(``zddrl.replay``) imports them from here. No torch, no sockets, no wire messages (``tests/test_layers.py``): an
actor host imports them without torch.
"""
