"""Where a learner update's time goes: torch.profiler over timed updates, summed by the cores' named regions.

``zddrl bench learner --profile`` runs the timed updates a second time under ``torch.profiler`` (CPU activity;
the profiler's own cost makes that pass slower, so the regions are reported as shares of the profiled pass and
as milliseconds scaled to the unprofiled update). Regions are ``zddrl.algos.core.PROFILE_REGIONS``; what lies
outside them ("other": batching, advantages, targets' arithmetic, indexing, Python) is the rest of the update.
The costliest operators by self time say what each region is made of.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

TOP_OPS = 8


def profile_updates(update: Callable[[Any], Any], batches: Sequence[Any], unprofiled_s: float) -> dict[str, Any]:
    """Run ``update`` on each batch under torch.profiler; shares and per-update milliseconds by region."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from zddrl.algos.core import PROFILE_REGIONS, profile_regions

    profile_regions(True)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for batch in batches:
                update(batch)
            wall = time.perf_counter() - t0
    finally:
        profile_regions(False)
    events = prof.key_averages()
    spent = {r: 0.0 for r in PROFILE_REGIONS}
    for e in events:
        if e.key.startswith("zddrl.") and e.key[6:] in spent:
            spent[e.key[6:]] += e.cpu_time_total / 1e6
    shares = {r: s / wall for r, s in spent.items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    per_update_ms = 1e3 * unprofiled_s / len(batches)
    ops = sorted((e for e in events if not e.key.startswith("zddrl.")), key=lambda e: -e.self_cpu_time_total)
    return {
        "profiled_update_ms": round(1e3 * wall / len(batches), 2),
        "shares": {r: round(v, 3) for r, v in shares.items()},
        "region_ms": {r: round(v * per_update_ms, 2) for r, v in shares.items()},
        "top_ops": [[e.key, round(e.self_cpu_time_total / 1e3 / len(batches), 2)] for e in ops[:TOP_OPS]],
        "threads": torch.get_num_threads(),
    }


def format_profile(row: dict[str, Any]) -> list[str]:
    """The report lines of one throughput row's profile."""
    p = row["profile"]
    lines = [
        f"  profile ({row['update_ms']:.1f} ms per update unprofiled, {p['profiled_update_ms']:.1f} ms profiled, "
        f"{p['threads']} thread(s)):",
        "    " + ", ".join(f"{r} {100 * s:.0f} % ({p['region_ms'][r]:.1f} ms)" for r, s in p["shares"].items()),
        "    costliest operators (self ms per update): " + ", ".join(f"{name} {ms:.1f}" for name, ms in p["top_ops"]),
    ]
    return lines
