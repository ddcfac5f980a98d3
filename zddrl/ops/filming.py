"""Videos while `zddrl train` runs: every ``train.video_every`` updates one greedy episode of the newest checkpoint,
filmed into ``RUN_DIR/videos/version-NNNNNNNN/episode-000.mp4``, and the final policy's when the run ends.

The learner writes a checkpoint at every multiple of ``video_every`` updates (learner/checkpoints.py); the filming
is `zddrl eval` of it in a child process at the lowest priority, at most one at a time, so that it takes only what
the run leaves idle and never holds the learner up (a checkpoint that comes while one is being filmed waits for the
next). The child reads a hard link to the checkpoint, made at once, so that the learner's rotation
(``keep_checkpoints``) cannot remove the file under it; the link goes when the filming ends. A filming that fails
costs its video and one log line, never the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from loguru import logger

from zddrl.config import TrainConfig
from zddrl.learner.runlog import latest_checkpoint
from zddrl.proc import die_with_parent

LOOK_EVERY_S = 1.0
"""How often the run's checkpoints are looked at."""
VIDEO_LOG = "video.log"


def _lowest_priority() -> None:
    die_with_parent()
    os.nice(19)


def checkpoint_version(path: Path) -> int:
    """The policy version in a periodic checkpoint's name (``ckpt-00000042.pt`` -> 42)."""
    return int(path.stem.removeprefix("ckpt-"))


class Filming:
    """``poll()`` in the run's watch loop; ``finish(wait_s)`` when the run is over; ``stop()`` in any case."""

    def __init__(self, run_dir: Path, train: TrainConfig, allow: list[str]) -> None:
        self.run_dir, self.train, self.allow = run_dir, train, allow
        self.videos = run_dir / "videos"
        self.next_version = train.video_every
        self.child: subprocess.Popen | None = None
        self.filming: tuple[int, Path] | None = None
        """(version, the hard link the child reads) of the filming in progress."""
        self.next_look = 0.0
        self.filmed = self.failed = 0

    def poll(self) -> None:
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + LOOK_EVERY_S
        if self.child is not None:
            if self.child.poll() is None:
                return
            self._ended()
        newest = latest_checkpoint(self.run_dir)
        if newest is not None and checkpoint_version(newest) >= self.next_version:
            self._film(newest)

    def _film(self, checkpoint: Path) -> None:
        version = checkpoint_version(checkpoint)
        self.next_version = version + self.train.video_every
        out = self._out(version)
        link = out.with_suffix(".pt")
        self.videos.mkdir(exist_ok=True)
        link.unlink(missing_ok=True)  # left by a run killed while filming (this one resumed)
        try:
            os.link(checkpoint, link)
        except OSError as exc:  # rotated away in the moment between the look and the link: the next one is filmed
            logger.info(f"video of version {version} skipped: its checkpoint went ({exc.strerror})")
            return
        args = ["eval", str(link), "--episodes", "1", "--max-episode-steps", str(self.train.video_max_steps)]
        cmd = [sys.executable, "-m", "zddrl", *args, "--video", str(out), "--json", *self.allow]
        with open(self.run_dir / "logs" / VIDEO_LOG, "a") as log:
            log.write(f"---- {time.strftime('%H:%M:%S')} version {version} ----\n")
            log.flush()
            self.child = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_lowest_priority
            )
        self.filming = (version, link)

    def _ended(self) -> None:
        assert self.child is not None and self.filming is not None
        (version, link), code = self.filming, self.child.returncode
        self.child = self.filming = None
        link.unlink(missing_ok=True)
        played = self._played(version)
        if code == 0 and played:
            self.filmed += 1
            logger.info(f"video of version {version}: {played}")
        else:
            self.failed += 1
            logger.warning(f"video of version {version} failed (exit {code}): see {self.run_dir / 'logs' / VIDEO_LOG}")

    def _out(self, version: int) -> Path:
        """The folder of version ``version``'s video (its checkpoint's link: the same name with ``.pt``)."""
        return self.videos / f"version-{version:08d}"

    def _played(self, version: int) -> str:
        """The episode file of version ``version``'s filming, if it wrote one."""
        found = sorted(self._out(version).glob("episode-*.mp4"))
        return str(found[0]) if found else ""

    def finish(self, wait_s: float) -> None:
        """The run is over: let a filming in progress end, then film the final checkpoint if one is due, within
        ``wait_s`` in all; then say what was filmed."""
        deadline = time.monotonic() + wait_s
        self._wait(deadline)
        self.next_look = 0.0
        self.poll()
        self._wait(deadline)
        if self.filmed or self.failed:
            logger.info(f"videos: {self.filmed} in {self.videos}" + (f", {self.failed} failed" if self.failed else ""))

    def _wait(self, deadline: float) -> None:
        if self.child is None:
            return
        try:
            self.child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("the video being filmed when the run ended took too long: stopped")
            self.stop()
        else:
            self._ended()

    def stop(self) -> None:
        """End a filming in progress now (Ctrl-C, an error): its partial file and the link go."""
        if self.child is None or self.filming is None:
            return
        if self.child.poll() is None:
            self.child.kill()
            self.child.wait()
        version, link = self.filming
        link.unlink(missing_ok=True)
        out = self._out(version)
        for partial in out.glob("*.mp4"):
            partial.unlink()
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        self.child = self.filming = None
