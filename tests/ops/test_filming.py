"""Videos while `zddrl train` runs (``train.video_every``, ops/filming.py): the learner checkpoints at every K
updates, the run films the newest checkpoint at the lowest priority into ``RUN_DIR/videos/version-N/``, a filming
survives the learner's rotation of its checkpoints, and one stopped mid-way leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import wait_for
from zddrl.algos.core import acting_model
from zddrl.config import Config, ConfigError
from zddrl.envs import probe_spec
from zddrl.learner.checkpoints import Checkpoints
from zddrl.learner.runlog import RunLog
from zddrl.ops.filming import Filming

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # zddrl eval (and train) processes


@pytest.fixture(autouse=True)
def video_extra() -> None:
    pytest.importorskip("imageio_ffmpeg")
    pytest.importorskip("pygame")  # classic control draws with it


def frames(video: Path) -> int:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(video))
    meta = next(reader)
    assert meta["size"][0] > 0 and meta["size"][1] > 0
    return sum(1 for _ in reader)


def test_a_run_films_its_policy_every_k_updates(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "zddrl", "train", str(ROOT / "examples" / "cartpole_ppo.toml"), "--run-dir", str(run),
         "--max-steps", "3072", "--set", "train.video_every=4", "--set", "train.video_max_steps=40"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    films = sorted((run / "videos").glob("version-*/episode-000.mp4"))
    assert films, done.stderr[-3000:]
    versions = [int(f.parent.name.removeprefix("version-")) for f in films]
    assert versions[0] >= 4 and all(b - a >= 4 for a, b in zip(versions, versions[1:])), versions
    assert all(0 < frames(f) <= 41 for f in films)  # the reset frame and at most video_max_steps steps
    assert not list((run / "videos").glob("*.pt")), "the links to the checkpoints are gone"
    assert f"video of version {versions[0]}: " in done.stderr and "videos: " in done.stderr
    played = [json.loads(line) for line in (run / "logs" / "video.log").read_text().splitlines() if line[:1] == "{"]
    assert len(played) >= len(films) and all(p["episodes"] == 1 for p in played)


def test_the_learner_checkpoints_at_every_kth_update() -> None:
    train = Config().replace({"train.video_every": 4, "train.checkpoint_every": 6, "train.checkpoint_every_s": 3600})
    ckpt = Checkpoints(None, train.train)  # type: ignore[arg-type]  # due() reads no files
    ckpt.last_updates = 1
    assert [u for u in range(2, 13) if ckpt.due(u)] == [4, 6, 8, 12]
    for bad in ("train.video_every=-1", "train.video_max_steps=0"):
        key, value = bad.split("=")
        with pytest.raises(ConfigError, match="video"):
            Config().replace({key: int(value)})


def checkpoint(run: Path, version: int) -> Path:
    """A periodic checkpoint as the learner writes one, of an untrained CartPole policy."""
    config = Config()
    torch.manual_seed(0)
    model = acting_model(config, probe_spec(config.env))
    log = RunLog(run, {})
    try:
        state = {"config": config.to_dict(), "model": model.state_dict(), "policy_version": version}
        return log.checkpoint(state, f"ckpt-{version:08d}.pt", keep=3)
    finally:
        log.close()


def test_a_filming_outlives_the_rotation_of_its_checkpoint_and_a_stopped_one_leaves_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    train = Config().replace({"train.video_every": 5, "train.video_max_steps": 30}).train
    filming = Filming(run, train, [])
    first = checkpoint(run, 3)
    filming.poll()
    assert filming.child is None, "version 3 is before the first multiple of 5"
    first.unlink()
    newest = checkpoint(run, 5)
    filming.next_look = 0.0
    filming.poll()
    assert filming.child is not None
    newest.unlink()  # the learner's rotation: the filming reads its own link
    filming.finish(wait_s=120)
    assert frames(run / "videos" / "version-00000005" / "episode-000.mp4") > 0
    assert filming.filmed == 1 and not list((run / "videos").glob("*.pt"))

    checkpoint(run, 10)
    filming.next_look = 0.0
    filming.poll()
    assert filming.child is not None
    t0 = time.monotonic()
    filming.stop()  # Ctrl-C: killed at once, its partial file and its link gone
    assert time.monotonic() - t0 < 10
    assert not (run / "videos" / "version-00000010").exists() and not list((run / "videos").glob("*.pt"))
    wait_for(lambda: filming.child is None, 1, "the child forgotten")
