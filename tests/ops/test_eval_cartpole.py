"""`zddrl eval` and `zddrl export` on the README's CartPole run: a run directory as the argument, videos of a
classic-control env, episode times that show, and one-line errors for what is not a checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from zddrl.algos.core import acting_model
from zddrl.cli.evaluate import duration
from zddrl.config import Config
from zddrl.envs import probe_spec
from zddrl.ops.evaluate import evaluate
from zddrl.ops.export import export_policy
from zddrl.ops.video import VideoError

ROOT = Path(__file__).resolve().parents[2]


def run_dir(tmp_path: Path) -> Path:
    """A run directory with a final checkpoint as the learner writes one, of an untrained CartPole policy."""
    config = Config()
    assert config.env.id == "CartPole-v1"
    torch.manual_seed(0)
    model = acting_model(config, probe_spec(config.env))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    state = {"config": config.to_dict(), "model": model.state_dict(), "policy_version": 3}
    torch.save(state, tmp_path / "run" / "checkpoints" / "final.pt")
    return tmp_path / "run"


def zddrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zddrl", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.slow  # a zddrl eval process
def test_eval_of_a_run_directory_films_cartpole_and_times_episodes_in_ms(tmp_path: Path) -> None:
    pytest.importorskip("imageio_ffmpeg")
    pytest.importorskip("pygame")
    videos = tmp_path / "videos"
    done = zddrl("eval", str(run_dir(tmp_path)), "--episodes", "2", "--max-episode-steps", "30", "--video", str(videos))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("episode ")]
    assert len(lines) == 2 and all(" ms, video " in line for line in lines), done.stdout
    assert " 0 ms" not in done.stdout  # rendering a frame per step takes more than half a millisecond
    assert sorted(p.name for p in videos.iterdir()) == ["episode-000.mp4", "episode-001.mp4"]
    assert all((videos / name).stat().st_size > 1000 for name in ("episode-000.mp4", "episode-001.mp4"))


def test_a_missing_renderer_is_one_line_and_leaves_no_empty_video_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pygame(self: gym.Env) -> None:
        raise gym.error.DependencyNotInstalled(
            'pygame is not installed, run `pip install "gymnasium[classic-control]"`'
        )

    monkeypatch.setattr("gymnasium.envs.classic_control.cartpole.CartPoleEnv.render", no_pygame)
    videos = tmp_path / "out" / "videos"
    with pytest.raises(VideoError, match=r"needs the video extra \(pygame is not installed\): .*pip install") as err:
        evaluate(str(run_dir(tmp_path)), 1, seed=0, video_dir=videos)
    assert "\n" not in str(err.value)
    assert not videos.exists()


def test_export_takes_a_run_directory(tmp_path: Path) -> None:
    out = tmp_path / "policy.pt"
    result = export_policy(run_dir(tmp_path), "torchscript", out)
    assert out.is_file() and result["env_id"] == "CartPole-v1" and result["max_error"] < 1e-5


@pytest.mark.slow  # zddrl eval processes
def test_eval_of_what_is_not_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    scripted = torch.jit.script(torch.nn.Linear(4, 2))
    torch.jit.save(scripted, tmp_path / "policy.pt")
    (tmp_path / "empty").mkdir()
    for target, why in ((tmp_path / "policy.pt", "is not a zddrl checkpoint"), (tmp_path / "empty", "holds no ckpt")):
        done = zddrl("eval", str(target), "--episodes", "1")
        assert done.returncode == 1
        assert done.stderr.strip().count("\n") == 0 and why.replace("ckpt", "checkpoint") in done.stderr, done.stderr


def test_durations_show_what_an_episode_took() -> None:
    assert [duration(s) for s in (0.0123, 0.9996, 1.0, 75.25)] == ["12 ms", "1000 ms", "1.0 s", "75.2 s"]
