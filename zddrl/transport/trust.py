"""What an actor host or a replay service takes from the network before it acts on it: a run it may join.

The run spec comes from the broker's welcome. Two things are judged before any of it is used:

* with keys (``credentials``), the spec must be signed by a learner key this host pins (protocol.signing):
  a broker or a peer that forges or alters a run cannot make actors join it;
* whatever the keys, it must not name code this host did not allow (``envs.env_refusal``, ``plugin.refusal``): an
  env id ``module:callable``, an ``algo.name`` or a ``model.kind`` ``module:attr`` is imported and run only if the
  host's own ``--allow-code`` lists it.
"""

from __future__ import annotations

from zddrl import keys
from zddrl import protocol as P
from zddrl.config import Config
from zddrl.envs import env_refusal
from zddrl.plugin import PluginError
from zddrl.transport import signatures as signing


def joinable(
    welcome: P.Welcome, credentials: keys.Credentials | None, allowed_code: frozenset[str]
) -> tuple[Config | None, str]:
    """``(config, "")`` of the welcome's run if this host may join it, else ``(None, why)``."""
    if welcome.run is None:
        return None, "the welcome names no run"
    if credentials is not None:
        why = signing.run_refusal(
            welcome.run_id, welcome.run, welcome.run_signer, welcome.run_signature, credentials.pins
        )
        if why:
            return None, f"run spec {why}"
    try:  # an algorithm or model of the user's own must be allowed here (checked before any import)
        config = Config.from_dict(welcome.run, allowed=allowed_code)
    except PluginError as exc:
        return None, str(exc)
    why = env_refusal(config.env.id, allowed_code)
    return (None, why) if why else (config, "")
