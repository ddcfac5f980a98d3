"""The suite in two phases on pytest-xdist's workers: every test not marked ``serial`` spread over the workers
(one per CPU this process may use), then the ``serial`` ones on one worker while no other test runs.

``serial`` is for tests whose promise holds only on a machine they have to themselves: timing measured against a
deadline, memory measured, benchmarks, network namespaces, a Slurm cluster. The controller does not collect
(the workers do), so each worker writes the node ids of its ``serial`` and ``slow`` tests to a folder the controller
gave it; the scheduler reads them once every worker has collected. The slow tests are handed out first, one at a
time, so that the quick ones even out the workers' ends. Without xdist (``-p no:xdist``, ``-n 0``) the tests run
in one process, in pytest's order, as before.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

try:
    from xdist.scheduler import LoadScheduling
except ImportError:  # pytest without xdist: the hooks below are never called
    LoadScheduling = object  # type: ignore[assignment,misc]

PHASES_DIR = "zddrl_phases_dir"
"""The key of the workers' input that names the folder they write their marked node ids to."""

LONGEST = (
    "tests/test_train_replay.py::test_sac_reaches_minus_200_on_pendulum",
    "tests/test_train_replay.py::test_apex_reaches_a_greedy_475_on_cartpole",
    "tests/test_pixel_learning.py::test_the_atari_examples_settings_learn_from_pixels",
    "tests/ops/test_filming.py::test_a_run_films_its_policy_every_k_updates",
    "tests/test_plugins.py::test_a_plugin_algorithm_and_a_plugin_network_train_cartpole",
    "tests/bench/test_bench_learner.py::test_bench_learner_smoke",
    "tests/test_train.py::test_scaling_1_and_4_actors_learn_alike_at_a_fixed_total_batch",
    "tests/ops/test_restart.py::test_train_restarts_the_whole_shard_group_when_one_shard_dies",
    "tests/test_train_replay.py::test_a_replay_service_on_a_closed_bus_serves_its_learner_at_the_replay_ratio",
    "tests/test_replay_service_e2e.py::test_the_buffer_survives_a_replay_kill_and_a_learner_restart",
)
"""Node id prefixes of the slow tests that took longest (60-270 s each in a run of 2026-12-03), handed out before the
other slow ones: a long test started last would keep one worker busy long after the others are done. A name no
longer there only loses its place."""

QUICK_CHUNK = 16
"""Quick tests go to a worker this many at a time at most: few messages, and at most ~2 s of imbalance at the end."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may use (xdist's own count takes physical cores from psutil,
    one on a 2-vCPU CI machine). PYTEST_XDIST_AUTO_NUM_WORKERS still overrides it."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if env:
        return int(env)
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "load":
        return None  # another --dist the command asked for: xdist's own
    return PhasedScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller: give each worker the folder it writes its marked tests to."""
    config = node.config
    if not hasattr(config, "_zddrl_phases_dir"):
        config._zddrl_phases_dir = tempfile.mkdtemp(prefix="zddrl-phases-")
    node.workerinput[PHASES_DIR] = config._zddrl_phases_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_zddrl_phases_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker: after every other hook has marked and deselected, write which of the tests it will run are marked."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or PHASES_DIR not in workerinput:
        return
    marked = {
        "serial": [item.nodeid for item in items if item.get_closest_marker("serial")],
        "slow": [item.nodeid for item in items if item.get_closest_marker("slow")],
    }
    path = Path(workerinput[PHASES_DIR]) / f"{workerinput['workerid']}.json"
    path.write_text(json.dumps(marked))


class PhasedScheduling(LoadScheduling):  # type: ignore[misc,valid-type]
    """xdist's load scheduling with the ``serial`` tests held back: once the others are done, every worker but
    one is shut down, and when they have finished, the one left runs the serial tests in collection order."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self.serial: list[int] = []
        self.slow: set[int] = set()
        self.serial_sent = False

    @property
    def tests_finished(self) -> bool:
        return not self.serial and super().tests_finished

    @property
    def has_pending(self) -> bool:
        return bool(self.serial) or super().has_pending

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:
            for node in self.nodes:
                self.check_schedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        marked = self._marked()
        index = {nodeid: i for i, nodeid in enumerate(self.collection)}
        self.serial = sorted(index[n] for n in marked["serial"] if n in index)
        self.slow = {index[n] for n in marked["slow"] if n in index}
        held = set(self.serial)
        rest = [i for i in range(len(self.collection)) if i not in held]
        # the slow ones first (the longest known first), so that the quick ones fill the workers' ends
        slow = sorted((i for i in rest if i in self.slow), key=lambda i: (self._rank(self.collection[i]), i))
        self.pending[:] = slow + [i for i in rest if i not in self.slow]
        for node in self.nodes:
            self.check_schedule(node)

    @staticmethod
    def _rank(nodeid: str) -> int:
        return next((k for k, prefix in enumerate(LONGEST) if nodeid.startswith(prefix)), len(LONGEST))

    def _marked(self) -> dict[str, list[str]]:
        folder = Path(getattr(self.config, "_zddrl_phases_dir", ""))
        for node in self.node2collection:
            path = folder / f"{node.workerinput['workerid']}.json"
            if path.is_file():
                marked: dict[str, list[str]] = json.loads(path.read_text())
                return marked
        return {"serial": [], "slow": []}

    def check_schedule(self, node: Any, duration: float = 0) -> None:
        if node.shutting_down:
            return
        if self.pending:
            self._fill(node)
        elif self.serial and not self.serial_sent:
            self._hand_over()
        elif not self.serial:
            node.shutdown()

    def _fill(self, node: Any) -> None:
        """Keep two tests queued on a worker (it runs one only once it knows the next): slow ones one at a time,
        quick ones in chunks."""
        queued = self.node2pending[node]
        if len(queued) >= 2:
            return
        if self.pending[0] in self.slow:
            self._send_tests(node, 2 - len(queued))
        else:
            share = len(self.pending) // max(1, len(self.node2pending)) // 4
            self._send_tests(node, max(2 - len(queued), min(QUICK_CHUNK, share)))

    def _hand_over(self) -> None:
        """The parallel phase has nothing left to hand out: keep one worker, shut the others down (they run what
        they hold and finish), then send the serial tests to the one left."""
        live = [n for n in self.nodes if not n.shutting_down]
        if not live:
            return
        keeper = live[0]
        for node in live[1:]:
            node.shutdown()
        if len(self.nodes) == 1:
            self.serial_sent = True
            tests, self.serial = self.serial, []
            self.node2pending[keeper].extend(tests)
            keeper.send_runtest_some(tests)

    def remove_node(self, node: Any) -> str | None:
        crashed = super().remove_node(node)
        if not self.pending and self.serial and not self.serial_sent:
            self._hand_over()
        return crashed

    def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
        super().add_node_collection(node, collection)
