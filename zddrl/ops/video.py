"""MP4 files of evaluation episodes: RGB frames in, H.264 out.

The encoder is imageio-ffmpeg's (the optional extra ``video``): its own ffmpeg binary with libx264, so the files
play in browsers and common players; OpenCV's wheels (installed for Atari) carry no H.264 encoder. Frames are
written as they come (nothing is held in memory), padded to even sizes as yuv420p requires.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from zddrl.proc import install_command


class VideoError(RuntimeError):
    """No encoder here, or frames it cannot write."""


def _encoder() -> Any:
    try:
        import imageio_ffmpeg
    except ImportError:
        raise VideoError(f"--video needs the video extra (imageio-ffmpeg): {install_command('video')}") from None
    return imageio_ffmpeg


class Mp4Writer:
    """``add(frame)`` for each ``[H, W, 3]`` uint8 frame, then ``close()``; the size is the first frame's."""

    def __init__(self, path: Path, fps: float) -> None:
        self.path, self.fps = Path(path), fps
        self.frames = 0
        self._writer: Any = None
        self._size: tuple[int, int] | None = None

    def add(self, frame: np.ndarray) -> None:
        frame = np.asarray(frame)
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise VideoError(f"frames must be [H, W, 3] uint8, got {frame.dtype} {list(frame.shape)}")
        h, w = frame.shape[0] + frame.shape[0] % 2, frame.shape[1] + frame.shape[1] % 2
        if self._writer is None:
            self._size = (w, h)
            self._writer = _encoder().write_frames(
                str(self.path),
                (w, h),
                fps=self.fps,
                codec="libx264",
                pix_fmt_out="yuv420p",
                macro_block_size=1,
                quality=7,
                ffmpeg_log_level="error",
            )
            self._writer.send(None)  # the generator starts ffmpeg at its first send
        if (w, h) != self._size:
            raise VideoError(f"frame size changed within an episode: {self._size} -> {(w, h)}")
        if (h, w) != frame.shape[:2]:
            frame = np.pad(frame, ((0, h - frame.shape[0]), (0, w - frame.shape[1]), (0, 0)))
        self._writer.send(np.ascontiguousarray(frame))
        self.frames += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
