"""The pixel figures' building blocks: the numpy Nature CNN that `zddrl bench actor` times against torch is the
same network, and the 29 MB Atari rollout of `zddrl bench bus` is a valid uint8 trajectory."""

from __future__ import annotations

import numpy as np
import torch

from zddrl import protocol as P
from zddrl.algos.flat import unflatten
from zddrl.algos.model import ActorCritic, flatten_params
from zddrl.bench import common as C
from zddrl.bench.actor import FRAMES, KINDS, numpy_nature_cnn
from zddrl.envs import EnvSpec


def test_the_numpy_nature_cnn_is_the_torch_one() -> None:
    model = ActorCritic(EnvSpec(FRAMES, True, 4, obs_dtype="uint8"), KINDS["nature_cnn"])
    flat, layout = flatten_params(model)
    pixels = np.random.default_rng(0).integers(0, 256, (2, *FRAMES), np.uint8)
    logits, values = numpy_nature_cnn(unflatten(flat, layout), pixels)
    with torch.no_grad():
        out, value = model.heads(torch.from_numpy(pixels))
    np.testing.assert_allclose(logits, out.numpy(), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(values, value.numpy(), rtol=1e-3, atol=1e-4)


def test_the_pixel_payload_is_an_atari_rollout_of_its_documented_size() -> None:
    arrays = C.trajectory_arrays(C.PIXEL_ROLLOUT_BYTES)
    assert sum(a.nbytes for a in arrays.values()) == C.PIXEL_ROLLOUT_BYTES == 29_149_728
    frames = P.encode(C.trajectory("r", 0, arrays))
    P.validate_trajectory(frames, P.DEFAULT_MAX_MESSAGE_BYTES)
    decoded = P.decode(frames)
    assert decoded.arrays["obs"].dtype == np.uint8 and decoded.arrays["obs"].shape == (128, 8, 4, 84, 84)
