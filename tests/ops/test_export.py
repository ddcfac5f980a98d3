"""`zddrl export`: the written file is the checkpoint's policy, run with torch alone or with onnxruntime.

Checkpoints are written as the learner writes them (config, model, policy version, observation statistics) with
networks of random weights, made large enough that actions reach the bounds of a Box. The reference is the network
itself, through its own methods, on 100 observations sampled from the env's observation space, normalised as the
actors normalise them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

from zddrl.algos.core import RunningMeanStd
from zddrl.algos.exported import ActorCriticPolicy
from zddrl.algos.flat import normalize_obs
from zddrl.algos.model import ActorCritic
from zddrl.algos.offpolicy_nets import DuelingQ, SquashedGaussian
from zddrl.cli import main
from zddrl.cli.export import FORMATS, export
from zddrl.config import Config
from zddrl.envs import EnvSpec, probe_spec
from zddrl.ops.export import FORMATS as export_formats
from zddrl.ops.export import WRITERS, write_torchscript

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")

PIXELS = "ZddrlExportPixels-v0"
OBSERVATIONS = 100
HEADS = {"pi", "log_std", "mu", "advantage", "value"}
"""The output layers of ActorCritic, SquashedGaussian and DuelingQ."""
TOL = 1e-5


class Pixels(gym.Env):
    """The spaces of a pixel env (all an export reads of it): ``[1, 42, 42]`` uint8 frames, 3 actions."""

    observation_space = gym.spaces.Box(0, 255, (1, 42, 42), np.uint8)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return np.zeros((1, 42, 42), np.uint8), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        return np.zeros((1, 42, 42), np.uint8), 0.0, True, False, {}


if PIXELS not in gym.registry:
    gym.register(PIXELS, entry_point=Pixels)

CASES = {
    "cartpole-ppo": ({"env.id": "CartPole-v1"}, ActorCritic),
    "pendulum-ppo-normalized": ({"env.id": "Pendulum-v1", "algo.normalize_obs": True}, ActorCritic),
    "pixels-impala-nature_cnn": (
        {"env.id": PIXELS, "algo.name": "impala", "model.kind": "nature_cnn", "model.hidden": [32]},
        ActorCritic,
    ),
    "pixels-impala-impala_cnn": (
        {"env.id": PIXELS, "algo.name": "impala", "model.kind": "impala_cnn", "model.hidden": [32]},
        ActorCritic,
    ),
    "cartpole-apex": ({"env.id": "CartPole-v1", "algo.name": "apex", "model.hidden": [32, 32]}, DuelingQ),
    "pendulum-sac": ({"env.id": "Pendulum-v1", "algo.name": "sac", "model.hidden": [32, 32]}, SquashedGaussian),
}


def write_checkpoint(tmp_path: Path, case: str) -> tuple[Path, torch.nn.Module, EnvSpec, dict | None]:
    """A checkpoint as the learner writes one; its network (the reference), the env's spec, its statistics."""
    overrides, network = CASES[case]
    config = Config().replace(overrides)
    spec = probe_spec(config.env)
    torch.manual_seed(0)
    net = network(spec, config.model).eval()
    with torch.no_grad():  # the heads start near 0 (gain 0.01): spread the actions, so that Box ones reach the bounds
        for name, p in net.named_parameters():
            if name.split(".")[0] in HEADS:
                p.add_(torch.randn_like(p) * 0.3)
    state: dict[str, Any] = {"config": config.to_dict(), "model": net.state_dict(), "policy_version": 7}
    rms = None
    if config.algo.normalize_obs:  # statistics far from (0, 1), as LearnerCore.state() stores them (float64)
        stats = RunningMeanStd(spec.obs_shape)
        stats.update(np.random.default_rng(0).normal(0.5, 3.0, (500, *spec.obs_shape)))
        rms = state["obs_rms"] = {"mean": torch.as_tensor(stats.mean), "var": torch.as_tensor(stats.var), "count": 1.0}
    path = tmp_path / "checkpoints" / "ckpt-00000007.pt"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return path, net, spec, rms


def observations(env_id: str) -> np.ndarray:
    """100 samples of the env's observation space; its unbounded dimensions (CartPole's velocities) cut to +-10,
    since a uniform draw over +-3.4e38 overflows any float32 network."""
    space = gym.make(env_id).observation_space
    assert isinstance(space, gym.spaces.Box)
    if np.issubdtype(space.dtype, np.floating):
        space = gym.spaces.Box(np.maximum(space.low, -10), np.minimum(space.high, 10), space.shape, space.dtype)
    space.seed(0)
    return np.stack([space.sample() for _ in range(OBSERVATIONS)])


def reference(net: torch.nn.Module, spec: EnvSpec, obs: np.ndarray, rms: dict | None) -> list[np.ndarray]:
    """``[action, dist_params]`` of the checkpoint's network, through its own methods."""
    if rms is not None:  # as the actors do: float32 statistics (algos/policy.py)
        obs = normalize_obs(obs, rms["mean"].numpy().astype(np.float32), rms["var"].numpy().astype(np.float32))
    x = torch.as_tensor(obs)
    low, high = np.asarray(spec.action_low, np.float32), np.asarray(spec.action_high, np.float32)
    with torch.no_grad():
        if isinstance(net, DuelingQ):
            q = net(x).numpy()
            return [q.argmax(axis=1), q]
        if isinstance(net, SquashedGaussian):
            mu, log_std = (t.numpy() for t in net(x))
            return [(high + low) / 2 + (high - low) / 2 * net.greedy(x).numpy(), np.concatenate([mu, log_std], 1)]
        out = net.heads(x)[0].numpy()
    if spec.discrete:
        return [out.argmax(axis=1), out]
    log_std = np.broadcast_to(net.log_std.detach().numpy(), out.shape)
    return [np.clip(out, low, high), np.concatenate([out, log_std], axis=1)]


def run_export(*args: str) -> Result:
    return CliRunner().invoke(export, list(args), catch_exceptions=False)


def check(got: list[np.ndarray], want: list[np.ndarray], discrete: bool) -> None:
    """Equal to ``TOL``, scaled by the outputs' size where they exceed 1: onnxruntime's convolutions sum in their own
    order, and the deep IMPALA CNN's logits of ~10 then differ from torch's by ~2e-5 (float32 rounding)."""
    if discrete:
        np.testing.assert_array_equal(got[0], want[0])
        assert got[0].dtype == np.int64
    for g, w in zip(got[int(discrete) :], want[int(discrete) :]):
        np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL * max(1.0, float(np.abs(w).max())))


@pytest.mark.parametrize("case", list(CASES))
def test_the_torchscript_file_is_the_checkpoints_policy(tmp_path: Path, case: str) -> None:
    ckpt, net, spec, rms = write_checkpoint(tmp_path, case)
    out = tmp_path / "policy.pt"
    done = run_export(str(ckpt), "--format", "torchscript", "-o", str(out))
    assert done.exit_code == 0, done.output
    assert done.output.startswith(f"{out}: torchscript, {type(net).__name__} of ")
    extra = {"zddrl.json": ""}
    module = torch.jit.load(str(out), _extra_files=extra)
    obs = observations(CASES[case][0]["env.id"])
    with torch.no_grad():
        got = [t.numpy() for t in module(torch.as_tensor(obs))]
    check(got, reference(net, spec, obs, rms), spec.discrete)
    meta = json.loads(extra["zddrl.json"])
    assert meta["obs_shape"] == list(spec.obs_shape) and meta["obs_dtype"] == spec.obs_dtype
    assert meta["policy_version"] == 7 and meta["obs_normalized"] == (rms is not None)
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("case", list(CASES))
def test_the_onnx_file_is_the_checkpoints_policy(tmp_path: Path, case: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    ckpt, net, spec, rms = write_checkpoint(tmp_path, case)
    out = tmp_path / "onnx" / "policy.onnx"
    done = run_export(str(ckpt), "--format", "onnx", "-o", str(out))
    assert done.exit_code == 0, done.output
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    obs = observations(CASES[case][0]["env.id"])
    got = session.run(["action", "dist_params"], {"obs": obs})
    check(got, reference(net, spec, obs, rms), spec.discrete)
    meta = json.loads(session.get_modelmeta().custom_metadata_map["zddrl"])
    assert meta["env_id"] == CASES[case][0]["env.id"] and meta["network"] == type(net).__name__


def test_the_files_run_where_zddrl_cannot_be_imported(tmp_path: Path) -> None:
    """The statistics and bounds are in the file: a process without zddrl gets the same actions."""
    pytest.importorskip("onnxruntime")
    ckpt, net, spec, rms = write_checkpoint(tmp_path, "pendulum-ppo-normalized")
    for fmt, name in (("torchscript", "p.pt"), ("onnx", "p.onnx")):
        assert run_export(str(ckpt), "--format", fmt, "-o", str(tmp_path / name)).exit_code == 0
    obs = observations("Pendulum-v1")
    np.save(tmp_path / "obs.npy", obs)
    script = (
        "import sys; sys.modules['zddrl'] = None\n"  # any import of zddrl now fails
        "import numpy as np, onnxruntime, torch\n"
        f"obs = np.load({str(tmp_path / 'obs.npy')!r})\n"
        f"a, p = (t.numpy() for t in torch.jit.load({str(tmp_path / 'p.pt')!r})(torch.as_tensor(obs)))\n"
        f"b, q = onnxruntime.InferenceSession({str(tmp_path / 'p.onnx')!r}).run(None, {{'obs': obs}})\n"
        f"np.savez({str(tmp_path / 'out.npz')!r}, a=a, p=p, b=b, q=q)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out, want = np.load(tmp_path / "out.npz"), reference(net, spec, obs, rms)
    check([out["a"], out["p"]], want, discrete=False)
    check([out["b"], out["q"]], want, discrete=False)


def test_actor_critic_forward_gives_the_distribution_parameters_and_the_value() -> None:
    for env_id, width in (("CartPole-v1", 2), ("Pendulum-v1", 2)):
        config = Config().replace({"env.id": env_id})
        net = ActorCritic(probe_spec(config.env), config.model)
        x = torch.randn(5, *probe_spec(config.env).obs_shape)
        params, value = net(x)
        out, v = net.heads(x)
        assert params.shape == (5, width) and value.shape == (5,) and torch.equal(value, v)
        assert torch.equal(params[:, : out.shape[1]], out)


def test_bad_checkpoints_formats_and_missing_packages_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = str(tmp_path / "p.pt")
    assert main.commands["export"] is export and FORMATS == export_formats
    missing = run_export(str(tmp_path / "none.pt"), "--format", "torchscript", "-o", out)
    assert missing.exit_code == 2 and "does not exist" in missing.output
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    bad = run_export(str(text), "--format", "torchscript", "-o", out)
    assert bad.exit_code == 1 and "is not a zddrl checkpoint" in bad.output
    assert len(bad.output.strip().splitlines()) == 1, bad.output
    ckpt = write_checkpoint(tmp_path, "cartpole-ppo")[0]
    unknown = run_export(str(ckpt), "--format", "tflite", "-o", out)
    assert unknown.exit_code == 2 and "'tflite' is not one of 'torchscript', 'onnx'" in unknown.output
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if it were not installed
    no_ort = run_export(str(ckpt), "--format", "onnx", "-o", str(tmp_path / "p.onnx"))
    assert no_ort.exit_code == 1 and "needs the onnxruntime package: pip install" in no_ort.output
    assert not (tmp_path / "p.onnx").exists() and not Path(out).exists()


def test_a_file_that_acts_otherwise_is_refused_and_not_left_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export checks the written file: here the writer drops the observation statistics."""
    ckpt, _, spec, _ = write_checkpoint(tmp_path, "pendulum-ppo-normalized")

    def without_statistics(policy: Any, example: torch.Tensor, path: Path, meta: dict) -> None:
        write_torchscript(ActorCriticPolicy(policy.net, spec, None).eval(), example, path, meta)

    monkeypatch.setitem(WRITERS, "torchscript", without_statistics)
    out = tmp_path / "p.pt"
    done = run_export(str(ckpt), "--format", "torchscript", "-o", str(out))
    assert done.exit_code == 1 and "does not compute the checkpoint's policy" in done.output
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
