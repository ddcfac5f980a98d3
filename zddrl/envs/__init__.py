"""Environment construction, space checks and the actor's vectorised stepping.

One module per responsibility, imports running one way (spaces <- atari <- make <- vector):

- ``spaces``: what a policy needs to know of an env (``EnvSpec``, ``env_spec``, ``env_action``) and ``EnvError``;
- ``atari``: zddrl's Atari preprocessing (``atari_wrappers``) and ALE's C++ vector env (``AleVecEnv``);
- ``make``: env ids and their constructors (``env_factory``, ``make_factory``, ``probe_spec``), the forms an
  ``env.id`` takes, ``env.kwargs``, and which ids an actor host may build (``env_refusal``);
- ``vector``: what an actor host steps (``ActorEnvs``, ``VecEnv``, ``actor_envs``) and envs slower than their own
  speed (``SlowEnvs``: ``EnvLatency``, ``Slowdown``).

Every public name is re-exported here: the rest of zddrl imports them from ``zddrl.envs``.
"""

from zddrl.envs.atari import ALE_ID as ALE_ID
from zddrl.envs.atari import ALE_VECTOR_KWARGS as ALE_VECTOR_KWARGS
from zddrl.envs.atari import MAX_FRAMES as MAX_FRAMES
from zddrl.envs.atari import AleVecEnv as AleVecEnv
from zddrl.envs.atari import FireReset as FireReset
from zddrl.envs.atari import LifeLoss as LifeLoss
from zddrl.envs.atari import atari_wrappers as atari_wrappers
from zddrl.envs.atari import rom_name as rom_name
from zddrl.envs.make import ATARI_HINT as ATARI_HINT
from zddrl.envs.make import ATARI_KWARGS as ATARI_KWARGS
from zddrl.envs.make import TYPED_KWARGS as TYPED_KWARGS
from zddrl.envs.make import env_factory as env_factory
from zddrl.envs.make import env_refusal as env_refusal
from zddrl.envs.make import evaluation_factory as evaluation_factory
from zddrl.envs.make import make_factory as make_factory
from zddrl.envs.make import pickled_env as pickled_env
from zddrl.envs.make import probe_spec as probe_spec
from zddrl.envs.spaces import OBS_DTYPES as OBS_DTYPES
from zddrl.envs.spaces import EnvError as EnvError
from zddrl.envs.spaces import EnvSpec as EnvSpec
from zddrl.envs.spaces import env_action as env_action
from zddrl.envs.spaces import env_spec as env_spec
from zddrl.envs.spaces import spec_of as spec_of
from zddrl.envs.vector import ActorEnvs as ActorEnvs
from zddrl.envs.vector import ActorEnvsFactory as ActorEnvsFactory
from zddrl.envs.vector import EnvLatency as EnvLatency
from zddrl.envs.vector import Slowdown as Slowdown
from zddrl.envs.vector import SlowEnvs as SlowEnvs
from zddrl.envs.vector import VecEnv as VecEnv
from zddrl.envs.vector import actor_envs as actor_envs
from zddrl.plugin import PICKLED as PICKLED
