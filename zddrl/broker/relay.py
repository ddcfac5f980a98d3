"""A relay: a broker whose learner is another broker (``zddrl broker --upstream tcp://ROOT:PORT``).

Actors join a relay exactly as they join a root broker (same protocol, same welcome, same credit). The relay:

* takes its run from its upstream's welcome (the run spec and its signature, passed on untouched, and the run's
  ``bus``, which it reads) and welcomes its actors into it; it takes no learners;
* forwards each admitted trajectory upstream on one PUSH, frames untouched (peer id, run id and version are the
  actor's), with credit end to end: it holds ``window`` unacknowledged at most, and reads its actors' socket only
  while it has credit left, so a learner that stops reading stops the root, the root stops acknowledging, the
  relay stops reading, and its actors block in their own window. Every trajectory read is forwarded or dropped
  with a reason: ``received == forwarded + dropped + in_flight`` holds here as at any broker;
* subscribes to its upstream's parameter versions, checks them as its own learners' would be checked
  (``publisher.Publisher``: every hash, and the signature against its pinned learner keys on a closed bus), and
  publishes and caches them for its actors (a late joiner gets the newest version from the relay);
* reports its subtree upstream (subtree messages: its actors, before each is welcomed, and its counters), so
  that the root's fleet message and ``zddrl status`` count the relay's actors (broker/subtree.py).

A relay is a ``Broker`` whose config names an upstream: its outlet and its side of the loop are
``upstream.UpstreamOutlet`` and ``upstream.Upstream``; the session itself (sockets, heartbeats, silence, fallback
list) is ``uplink.Uplink``.
"""

from __future__ import annotations

import zmq

from zddrl import keys
from zddrl.broker.broker import Broker
from zddrl.broker.upstream import RelayRefused
from zddrl.brokerconf import BrokerConfig
from zddrl.tomlconf import ConfigError

__all__ = ["Relay", "RelayRefused"]


class Relay(Broker):
    """``Relay(config, credentials=...).bind()`` then ``run(stop)``, ``close()`` in a finally, as a Broker, with
    ``config.upstream`` set. ``credentials``: the relay's client keys towards its upstream on a closed bus
    (``keys.relay_credentials``: its relay key and the upstream's public key, docs/security.md); ``key``: its own
    broker pair's name, as a Broker's."""

    def __init__(
        self,
        config: BrokerConfig,
        context: zmq.Context | None = None,
        credentials: keys.Credentials | None = None,
        key: str | None = None,
    ) -> None:
        if not config.upstream:
            raise ConfigError("a relay needs broker.upstream (--upstream tcp://ROOT:PORT)")
        super().__init__(config, context, credentials, key)
