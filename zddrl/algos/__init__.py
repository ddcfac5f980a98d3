"""Learning: returns and V-trace, losses, models, the optimizer and the learner cores.

Pure computation: nothing here imports sockets, the transport or the wire messages. Cores take
trajectories through the small ``algos.rollout.Rollout`` interface. ``flat`` (parameter layouts, observation
normalisation) is numpy-only, so actor hosts import it without torch.
"""
