"""The broker: the one address of a run. Routes trajectories actor -> learner shards by credit, fans
parameters out to every actor, keeps membership, accounting and health. Imports protocol and transport."""

from zddrl.broker.broker import Broker

__all__ = ["Broker"]
