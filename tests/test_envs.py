"""env.id in every form gymnasium.make takes, env.kwargs to the constructor, and the errors around them
(zddrl.envs: env_factory, make_factory, probe_spec)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest

from zddrl.config import EnvConfig
from zddrl.envs import EnvError, actor_envs, env_factory, make_factory, probe_spec

MODULE = "zddrl_test_envs_mod"
SIZED = "zddrl_test/Sized-v0"
SOURCE = f'''
import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv


class SizedEnv(CartPoleEnv):
    def __init__(self, size=4, render_mode=None):
        super().__init__(render_mode=render_mode)
        self.size = size


gym.register("{SIZED}", entry_point=SizedEnv, max_episode_steps=50)


def make(size=4):
    return SizedEnv(size)
'''


@pytest.fixture
def test_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module on sys.path that registers ``zddrl_test/Sized-v0`` when imported and has a ``make`` factory; its
    import and registration are undone afterwards."""
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    (tmp_path / "zddrl_test_boom.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)
    gym.registry.pop(SIZED, None)


@pytest.mark.parametrize("suffix", [SIZED, "zddrl_test/Sized"])
def test_module_colon_env_id_imports_the_module_then_finds_its_registered_id(test_module: str, suffix: str) -> None:
    env = make_factory(EnvConfig(id=f"{test_module}:{suffix}", kwargs={"size": 8}))()
    assert env.unwrapped.size == 8  # type: ignore[attr-defined]
    assert env.spec is not None and env.spec.max_episode_steps == 50
    env.close()


def test_versionless_and_namespaced_ids(test_module: str) -> None:
    assert probe_spec("CartPole").obs_shape == (4,)
    __import__(test_module)
    assert probe_spec(EnvConfig(id="zddrl_test/Sized")).action_dim == 2


def test_kwargs_go_to_gymnasium_make() -> None:
    env = make_factory(EnvConfig(id="FrozenLake-v1", kwargs={"map_name": "8x8", "is_slippery": False}))()
    assert env.unwrapped.desc.shape == (8, 8)  # type: ignore[attr-defined]
    assert len(env.unwrapped.P[0][0]) == 1  # type: ignore[attr-defined]  # not slippery: one outcome per move
    env.close()


def test_kwargs_go_to_a_module_callable_factory(test_module: str) -> None:
    env = make_factory(EnvConfig(id=f"{test_module}:make", kwargs={"size": 3}, max_episode_steps=7))()
    assert env.unwrapped.size == 3 and isinstance(env, gym.wrappers.TimeLimit)  # type: ignore[attr-defined]
    env.close()


@pytest.mark.parametrize("env_id", ["FrozenLake-v1", f"{MODULE}:make"])
def test_a_kwarg_the_constructor_refuses_is_one_line(test_module: str, env_id: str) -> None:
    make = make_factory(EnvConfig(id=env_id, kwargs={"colour": "red"}))  # resolving builds nothing
    with pytest.raises(EnvError, match="does not take env.kwargs") as caught:
        make()
    assert "\n" not in str(caught.value) and "colour" in str(caught.value)
    with pytest.raises(EnvError, match="does not take env.kwargs"):  # what `zddrl train` reports
        probe_spec(EnvConfig(id=env_id, kwargs={"colour": "red"}))


@pytest.mark.parametrize(
    ("env_id", "atari", "key", "typed"),
    [
        ("CartPole-v1", False, "max_episode_steps", "env.max_episode_steps"),
        ("CartPole-v1", False, "render_mode", "zddrl sets it"),
        ("ALE/Pong-v5", True, "repeat_action_probability", "env.repeat_action_probability"),
        ("ALE/Pong-v5", True, "frameskip", "env.atari"),
    ],
)
def test_a_kwarg_zddrl_sets_itself_is_refused(env_id: str, atari: bool, key: str, typed: str) -> None:
    with pytest.raises(EnvError, match=f"env.kwargs sets '{key}'.*{typed}"):
        make_factory(EnvConfig(id=env_id, atari=atari, kwargs={key: 1}))


def test_kwargs_are_refused_with_the_ale_vector_backend() -> None:
    config = EnvConfig(id="ALE/Pong-v5", atari=True, backend="ale_vector", kwargs={"mode": 0})
    with pytest.raises(EnvError, match="not with env.backend 'ale_vector'"):
        make_factory(config)
    with pytest.raises(EnvError, match="not with env.backend 'ale_vector'"):
        actor_envs(config, [1])


def test_an_ale_id_without_env_atari_gets_a_hint() -> None:
    hint = "env.id 'ALE/Pong-v5' is an Atari game: set env.atari = true"
    with pytest.raises(EnvError, match=hint):
        make_factory(EnvConfig(id="ALE/Pong-v5"))


def test_an_old_atari_id_without_env_atari_gets_a_hint() -> None:
    pytest.importorskip("ale_py")
    with pytest.raises(EnvError, match="'PongNoFrameskip-v4' is an Atari game: set env.atari = true"):
        env_factory("PongNoFrameskip-v4")


@pytest.mark.parametrize("env_id", ["zddrl_test_boom:Boom-v0", "zddrl_test_boom:make"])
@pytest.mark.parametrize("atari", [False, True])
def test_an_id_with_a_colon_is_refused_by_the_allowlist_before_import(
    test_module: str, env_id: str, atari: bool
) -> None:
    with pytest.raises(EnvError, match="does not allow it"):
        make_factory(EnvConfig(id=env_id, atari=atari), allowed=frozenset({f"{test_module}:{SIZED}"}))
    assert "zddrl_test_boom" not in sys.modules
    env = make_factory(EnvConfig(id=f"{test_module}:{SIZED}"), allowed=frozenset({f"{test_module}:{SIZED}"}))()
    env.close()


def test_unknown_ids_and_modules_are_clear_errors() -> None:
    with pytest.raises(EnvError, match="unknown gymnasium env id 'NoSuchEnv-v0'"):
        env_factory("NoSuchEnv-v0")
    with pytest.raises(EnvError, match="cannot be imported"):
        env_factory("zddrl_no_such_module:NoSuchEnv-v0")


class _Spaces(gym.Env):
    def __init__(self, obs: gym.Space, act: gym.Space) -> None:
        self.observation_space, self.action_space = obs, act


@pytest.mark.parametrize(
    ("obs", "act", "refused"),
    [
        (gym.spaces.Box(0, 255, (3, 4, 2), "uint8"), gym.spaces.Discrete(3), ""),
        (gym.spaces.Box(-1, 1, (), "float64"), gym.spaces.Box(-2, 2, (2,)), ""),
        (gym.spaces.Discrete(16), gym.spaces.Discrete(4), "observation space"),  # FrozenLake's
        (gym.spaces.Box(-1, 1, (2,)), gym.spaces.Box(-1, 1, (2, 2)), "action space"),
        (gym.spaces.Box(-1, 1, (2,)), gym.spaces.MultiDiscrete([2, 2]), "action space"),
    ],
)
def test_the_spaces_zddrl_takes_are_the_ones_extending_md_names(obs: gym.Space, act: gym.Space, refused: str) -> None:
    """docs/extending.md: observations a Box of any shape (uint8 pixels stay uint8), actions Discrete or a 1-D Box;
    anything else is one line at start-up naming the space."""
    from zddrl.envs import env_spec

    if not refused:
        spec = env_spec(_Spaces(obs, act))
        assert spec.obs_shape == obs.shape and spec.obs_dtype == ("uint8" if obs.dtype == "uint8" else "float32")
        return
    with pytest.raises(EnvError, match=f"^{refused} .* is not supported"):
        env_spec(_Spaces(obs, act))
