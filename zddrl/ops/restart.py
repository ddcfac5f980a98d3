"""Restarting a learner that died: whether to, when, from where, and what to say about it.

Used by `zddrl train` (ops/train.py), which restarts the learner among its local processes, and by
`zddrl learner --restart N` (:func:`supervise_learner`), which runs the learner as its child.
torch-free: the supervising process never needs it.

A learner is restarted when it exits with anything but 0 (it stopped by itself: target, step or
time limit, or asked to) or 2 (a usage error: the same command line or config would be refused
again). It comes back from the newest checkpoint of its run directory with ``--resume``, exactly
as a person would continue the run; with no checkpoint yet it starts the run afresh in the same
directory (a fresh learner refuses a directory only once it holds checkpoints: ``learner.checkpoints.check_run_dir``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loguru import logger

from zddrl.learner.runlog import latest_checkpoint
from zddrl.proc import die_with_parent

RESTART_BACKOFF_FIRST_S = 1.0
"""Wait before the first restart. Not less than the broker's heartbeat interval (1 s by default): a new learner
whose hello comes sooner after the dead one's last message is refused its peer id (membership.id_conflict)."""
RESTART_BACKOFF_FACTOR = 2.0
"""Each further restart waits this many times longer than the one before ..."""
RESTART_BACKOFF_MAX_S = 30.0
"""... up to this."""
USAGE_ERROR_EXIT = 2
"""click's exit status for a usage error: restarting would be refused the same way."""
LOG_TAIL_LINES = 12
"""Lines of a dead learner's log quoted with the restart."""
LOG_TAIL_BYTES = 16_384
POLL_S = 0.1
STOP_GRACE_S = 10.0
"""After SIGTERM, a supervised learner gets this long (its shard launcher needs 4 s) before SIGKILL."""
ORPHAN_GRACE_S = 10.0
"""How long the shards of a killed launcher get to stop on their own before a restart kills them."""


class RestartBudget:
    """At most ``max_restarts`` restarts in a run; the n-th (1-based) waits
    ``min(max_s, first_s * factor ** (n - 1))`` seconds. Restarts are counted over the whole run:
    a learner that keeps dying, early or late, runs out."""

    def __init__(
        self,
        max_restarts: int,
        first_s: float = RESTART_BACKOFF_FIRST_S,
        factor: float = RESTART_BACKOFF_FACTOR,
        max_s: float = RESTART_BACKOFF_MAX_S,
    ) -> None:
        if max_restarts < 0 or first_s < 0 or factor < 1 or max_s < first_s:
            raise ValueError("need max_restarts >= 0, first_s >= 0, factor >= 1 and max_s >= first_s")
        self.max_restarts = max_restarts
        self.first_s, self.factor, self.max_s = first_s, factor, max_s
        self.used = 0
        """Restarts granted so far."""

    def next_delay_s(self) -> float | None:
        """Grant one more restart and return its back-off in seconds, or None when the budget is spent."""
        if self.used >= self.max_restarts:
            return None
        delay = min(self.max_s, self.first_s * self.factor**self.used)
        self.used += 1
        return delay


def restartable(returncode: int) -> bool:
    """Whether a learner that exited with ``returncode`` is worth restarting (see the module docstring)."""
    return returncode not in (0, USAGE_ERROR_EXIT)


def exit_cause(returncode: int) -> str:
    """``returncode`` in words: "killed by SIGKILL", "exited with code 1"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode > 128:  # a shell, or a launcher that reports its child's death this way
        try:
            return f"exited with code {returncode} ({signal.Signals(returncode - 128).name}?)"
        except ValueError:
            pass
    return f"exited with code {returncode}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (read from its end only), or "" if there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def resume_point(run_dir: Path, t0: float) -> tuple[bool, float]:
    """How to start a learner again: ``(resume, learner_t0)``.

    With a checkpoint: resume from it, with the learner's clock (``--t0``) at the checkpoint's write
    time. The checkpoint carries the run's wall seconds up to then, which the learner counts on from
    its ``t0``: so wall_s goes on from the command's start, the time lost to the crash included,
    without counting the part before the checkpoint twice. Without one: afresh, on the command's
    own clock ``t0``.

    The learner then measures ``train.max_seconds`` from the later clock too, so the supervisor stops
    it itself (SIGTERM, a clean stop) once the command's own limit is reached: :func:`overdue`.
    """
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return False, t0
    try:
        return True, max(t0, checkpoint.stat().st_mtime)
    except OSError:  # pruned in between: cannot happen with the learner dead, but never fail on it
        return True, t0


def overdue(t0: float, learner_t0: float, max_seconds: float) -> bool:
    """Whether a restarted learner (running on ``learner_t0``) has passed the command's time limit."""
    return learner_t0 != t0 and time.time() - t0 >= max_seconds


def wait_for_group(pgid: int, grace_s: float = ORPHAN_GRACE_S) -> float:
    """Wait until no process is left in process group ``pgid`` (a dead learner's: its shards, when a
    launcher was killed, stop on their own by PDEATHSIG), at most ``grace_s``; then SIGKILL the rest.
    Returns the seconds it waited. A restarted learner must not meet the old one's shards: they would
    hold its peer id at the broker and could still write into the run directory."""
    started = time.monotonic()
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return time.monotonic() - started
        except PermissionError:  # not ours: nothing to wait for
            return 0.0
        if time.monotonic() - started >= grace_s:
            logger.warning(
                f"processes of the dead learner's group {pgid} still run after {grace_s:.0f} s: killing them"
            )
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return time.monotonic() - started
        time.sleep(POLL_S)  # a supervisor's poll, not a synchronisation


def describe_restart(n: int, budget: RestartBudget, cause: str, delay_s: float, resume: bool, tail: str) -> str:
    """The log line of a restart: which one, why, when, from where; and the dead learner's last words."""
    source = (
        "the newest checkpoint"
        if resume
        else "scratch (no checkpoint yet; the run starts afresh in the same directory)"
    )
    text = f"the learner {cause}: restart {n} of {budget.max_restarts} in {delay_s:.1f} s, from {source}"
    if tail:
        text += "; the end of its log:\n" + "\n".join(f"    | {line}" for line in tail.splitlines())
    return text


def give_up_message(budget: RestartBudget, cause: str, where: str | Path, run_dir: Path, tail: str = "") -> str:
    """The error of a learner that died once more than the budget allows."""
    last = tail.strip().splitlines()[-1].strip() if tail.strip() else ""
    then = (
        f"continue the run with --resume {run_dir} once the cause is fixed"
        if latest_checkpoint(run_dir)
        else "the run has no checkpoint to continue from"
    )
    return (
        f"the learner {cause} after {budget.used} restart(s) ({budget.max_restarts} allowed): giving up"
        f"{f' (its last line: {last})' if last else ''}; see {where}; {then}"
    )


# ------------------------------------------------------------------------------------------------
# `zddrl learner --restart N`
# ------------------------------------------------------------------------------------------------
class SupervisorError(RuntimeError):
    """The supervised learner failed for good; the text says how and why it was not restarted."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


SUPERVISOR_OPTIONS = ("--run-dir", "--restart", "--t0")
"""The options of a ``zddrl learner`` command line that the supervisor sets itself in each child's."""


def without_options(argv: Sequence[str], valued: Sequence[str], flags: Sequence[str] = ()) -> list[str]:
    """``argv`` without the options ``valued`` (in click's forms ``--opt VALUE`` and ``--opt=VALUE``) and the
    ``flags``; arguments after ``--`` are kept as they are."""
    kept: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--":
            kept += [arg, *args]
            break
        if arg in flags:
            continue
        if arg in valued:
            next(args, None)
            continue
        if arg.split("=", 1)[0] in valued and "=" in arg:
            continue
        kept.append(arg)
    return kept


def supervise_learner(argv: Sequence[str], run_dir: Path, t0: float, max_restarts: int, max_seconds: float) -> None:
    """Run ``python -m zddrl *argv`` (a ``zddrl learner`` command line) as a child and restart it when it dies.

    A child, not an in-process retry: the supervisor outlives any death of the learner (an exception,
    a shard group that failed, a segfault, the OOM killer or SIGKILL), and every restart is the tested
    ``--resume`` path in a clean process (an exception can leave a CUDA context or a torch.distributed
    group unusable for the rest of its process). What it does not cover is its own death: a SIGKILLed
    supervisor takes its learner with it (PR_SET_PDEATHSIG) and restarts nothing.

    SIGINT/SIGTERM are forwarded to the learner (a second one kills it) and end supervision: a learner
    asked to stop is never restarted. Returns when the learner exited cleanly; raises
    :class:`SupervisorError` when it failed for good.
    """
    budget = RestartBudget(max_restarts)
    stopping: list[int] = []
    child: list[subprocess.Popen] = []

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signum if len(stopping) == 1 else signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    resume, learner_t0 = "--resume" in argv, t0
    base = [*without_options(argv, SUPERVISOR_OPTIONS, ("--resume",)), "--run-dir", str(run_dir), "--restart", "0"]
    try:
        while True:
            args = [*base, "--t0", repr(learner_t0), *(["--resume"] if resume else [])]
            child[:] = [
                subprocess.Popen([sys.executable, "-m", "zddrl", *args], preexec_fn=own_group_dying_with_parent)
            ]
            code, termed = _run_child(child[0], stopping, overdue_at=(t0, learner_t0, max_seconds))
            if code == 0:
                return
            cause = exit_cause(code)
            if stopping or termed:
                raise SupervisorError(f"the learner {cause} while stopping", code if code > 0 else 1)
            if not restartable(code):
                raise SupervisorError(f"the learner {cause} (a usage error: not restarted)", code)
            delay = budget.next_delay_s()
            if delay is None:
                raise SupervisorError(give_up_message(budget, cause, "its output above", run_dir))
            resume, _ = resume_point(run_dir, t0)
            logger.warning(describe_restart(budget.used, budget, cause, delay, resume, ""))
            waited = wait_for_group(child[0].pid)  # the child leads its own group (own_group_dying_with_parent)
            _wait(delay - waited, stopping)
            resume, learner_t0 = resume_point(run_dir, t0)  # now: an orphaned shard 0 may have checkpointed
            if stopping:
                raise SupervisorError(f"stopped by {signal.Signals(stopping[0]).name} before restart {budget.used}")
    finally:
        if child:
            _stop_child(child[0])
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run_child(proc: subprocess.Popen, stopping: list[int], overdue_at: tuple[float, float, float]) -> tuple[int, bool]:
    """Wait for one learner child to exit; SIGTERM it once when the run's time is up. Returns its exit code and
    whether it was told to stop for time."""
    t0, learner_t0, max_seconds = overdue_at
    if stopping:  # a signal between two children
        proc.send_signal(stopping[0])
    termed = False
    while proc.poll() is None:
        if not termed and not stopping and overdue(t0, learner_t0, max_seconds):
            logger.info(f"train.max_seconds ({max_seconds:.0f} s) reached: stopping the restarted learner")
            proc.send_signal(signal.SIGTERM)
            termed = True
        try:
            proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
    return proc.returncode, termed


def _stop_child(proc: subprocess.Popen) -> None:
    """A learner still running when supervision ends (an exception, a signal): SIGTERM, then SIGKILL after a grace."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def own_group_dying_with_parent() -> None:
    """In a learner child, before exec: its own process group, so that a terminal's Ctrl-C reaches only its
    supervisor, which forwards it once (a shard launcher takes a second SIGINT as "kill the shards now"), and
    so that its shards can be found when it dies (:func:`wait_for_group`); and SIGTERM when the supervisor dies."""
    os.setpgid(0, 0)
    die_with_parent()


def _wait(delay_s: float, stopping: list[int]) -> None:
    """The back-off: ``delay_s`` seconds on the monotonic clock, cut short by a stop signal."""
    deadline = time.monotonic() + delay_s
    while not stopping and time.monotonic() < deadline:
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
