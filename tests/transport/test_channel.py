"""A learner shard's DataChannel against a ROUTER standing in for the broker's learners socket (inproc).

The credit the channel grants is what the broker may send it: the window (messages), bounded by
WINDOW_BYTES at the size of the last trajectory (never below MIN_WINDOW, never above the window).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import zmq

from samples import traj, traj_arrays
from zddrl import protocol as P
from zddrl.transport.channel import MIN_WINDOW, WINDOW_BYTES, DataChannel


class FakeBroker:
    """The broker's side of the learners socket: takes credit, sends trajectories behind the shard's identity."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.credit = 0

    def take_credit(self, expect: int | None = None) -> int:
        """Credit held after reading every grant that came; with ``expect``, wait (2 s at most) to hold that."""
        deadline = time.monotonic() + 2.0
        while self.sock.poll(0 if expect is None or self.credit == expect else 10):
            _, *frames = self.sock.recv_multipart()
            msg = P.decode(frames)
            if isinstance(msg, P.Credit):
                self.credit += msg.credit
            if time.monotonic() > deadline:
                break
        return self.credit

    def send(self, msg: P.Message | list) -> None:
        frames = msg.encode() if isinstance(msg, P.Message) else msg
        self.credit -= 1
        self.sock.send_multipart([b"learner-0", *frames], copy=False)


@pytest.fixture
def pair():
    ctx = zmq.Context()
    endpoint = "inproc://learners"
    broker = FakeBroker(ctx, endpoint)
    link = SimpleNamespace(endpoint=lambda name: endpoint, generation=0, socket=ctx.socket, data_identity=b"learner-0")
    channels: list[DataChannel] = []

    def make(window: int) -> DataChannel:
        channels.append(DataChannel(link, "learner-0", P.DEFAULT_MAX_MESSAGE_BYTES, window))
        return channels[-1]

    yield broker, make
    for channel in channels:
        channel.close()
    broker.sock.close(linger=0)
    ctx.term()


def consume(broker: FakeBroker, channel: DataChannel, msg: P.Message | list, n: int) -> list[int]:
    """Send ``n`` messages as credit allows, the channel acking each trajectory; the broker's credit after each."""
    held = []
    for _ in range(n):
        assert broker.take_credit(channel.outstanding) > 0, "the channel left the broker without credit"
        broker.send(msg)
        if isinstance(channel.recv(2000), P.Trajectory):
            channel.ack()
        held.append(broker.take_credit(channel.outstanding))  # nothing in flight: the broker holds all granted
        assert held[-1] == channel.outstanding
    return held


def test_small_trajectories_keep_the_full_window(pair) -> None:
    broker, make = pair
    channel = make(64)
    held = consume(broker, channel, traj(), 100)
    assert channel.window == 64 and max(held) == 64 and min(held) >= 32  # given back in halves of the window


def test_big_trajectories_shrink_the_window_to_the_byte_budget(pair) -> None:
    broker, make = pair
    channel = make(64)
    big = traj(arrays=traj_arrays(T=2, N=2, obs_shape=(1 << 19,)))  # obs 8 MiB, next_obs 4 MiB: > WINDOW_BYTES / 4
    held = consume(broker, channel, big, 80)
    assert channel.window == MIN_WINDOW == max(MIN_WINDOW, WINDOW_BYTES // channel.last_bytes)
    assert max(held[63:]) <= MIN_WINDOW  # the first grant runs out; no later one is bigger than the budget


def test_a_window_smaller_than_the_floor_stays_small(pair) -> None:
    """Async learners size their window to about one batch (e.g. 3): the byte bound never raises it."""
    broker, make = pair
    channel = make(3)
    held = consume(broker, channel, traj(), 20)
    assert channel.window == 3 and max(held) <= 3


def test_a_trajectory_that_fails_to_decode_returns_its_credit(pair) -> None:
    broker, make = pair
    channel = make(4)
    frames = [bytes(P._buffer(f)) for f in traj().encode()]
    broken = [frames[0], frames[1], *frames[2:-1]]  # one array frame short
    for _ in range(10):
        assert broker.take_credit(channel.outstanding) > 0
        broker.send(broken)
        assert channel.recv(2000) is None
    assert broker.take_credit(channel.outstanding) == channel.outstanding > 0


def test_regrant_after_a_rewelcome_never_lets_the_count_go_negative(pair) -> None:
    broker, make = pair
    channel = make(8)
    broker.take_credit()
    channel.regrant(1)  # the broker forgot us: it starts from zero, we grant the window again
    for _ in range(3):  # trajectories it had sent under the old credit arrive afterwards
        broker.send(traj())
        assert isinstance(channel.recv(2000), P.Trajectory)
        channel.ack()
    assert 0 <= channel.outstanding <= channel.window
