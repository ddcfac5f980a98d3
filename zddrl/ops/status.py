"""`zddrl status`: ask a broker for its counters and show them as a table, once or live (``--watch``).

The broker's status body (docs/protocol.md, section 9) carries the counters, the fleet's counts by role
and host, one page of members with their last stats (a fleet of up to a few hundred members is all on
page 1), the fleet's health warnings and the last departures (with crash reports). The same rows
feed the plain-text table and the live view: ``rich`` when it is installed and stdout is a terminal,
otherwise plain text (the screen cleared between frames on a terminal, frames one after another when
piped to a file).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from zddrl import protocol as P
from zddrl.keys import Credentials
from zddrl.transport.status import ask_status
from zddrl.values import finite_float

MIN_INTERVAL_S = 0.1
"""Shortest --watch refresh period: each frame is a status request the broker must answer."""
REASON_CHARS = 120
"""Departure reasons are shown up to this many characters of their first line (crash reports carry a
traceback: `zddrl status --json` has it in full)."""


# ------------------------------------------------------------------------------------------------
# Rows shared by the table and the live view (header row first)
# ------------------------------------------------------------------------------------------------


def _table(rows: list[list[str]], indent: str = "") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _number(value: Any, fmt: str, default: str = "-") -> str:
    x = finite_float(value)
    return default if x is None else format(x, fmt)


def summary_lines(body: dict[str, Any]) -> list[str]:
    b = body["broker"]
    dropped = ", ".join(f"{k} {v}" for k, v in b["dropped"].items())
    lines = [
        f"broker {b['host']}  run {b['run_id'] or '-'}  version {b['policy_version']}  up {b['uptime_s']:.0f} s",
        f"trajectories: received {b['received']} = forwarded {b['forwarded']} + dropped "
        f"{sum(b['dropped'].values())} ({dropped}) + in flight {b['in_flight']}"
        f"  [{'ok' if b['accounted'] else 'MISMATCH'}]",
        f"bytes in {b['bytes_in']}  out {b['bytes_out']}  params published {b.get('params_published', 0)}",
        f"now: in {b.get('in_msgs_per_s', 0):.0f} msgs/s ({b.get('in_bytes_per_s', 0) / 1e6:.1f} MB/s)  "
        f"out {b.get('out_msgs_per_s', 0):.0f} msgs/s  learner credit {b.get('credit', 0)}",
    ]
    if "members_total" in b:  # a broker before status pages sent every member and no counts
        roles = ", ".join(f"{n} {role}" for role, n in b["members_by_role"].items() if n)
        page = f"  page {b['page']} of {b['pages']} (--page N)" if b["pages"] > 1 or b["page"] > 1 else ""
        lines.append(f"members {b['members_total']} ({roles or 'none'}) on {b['hosts_total']} hosts{page}")
    lines += tree_lines(b) + standby_lines(b)
    learners = [m["stats"] for m in body["members"].values() if m["role"] == "learner" and m.get("stats")]
    learner = min(learners, key=lambda s: s.get("shard", 0), default=None)  # the main shard reports the run
    if learner:
        ret = learner.get("return_mean_20")
        lines.append(
            f"learner: version {learner.get('policy_version')}  updates {learner.get('updates')} "
            f"({learner.get('updates_per_s', 0):.1f}/s, {learner.get('samples_per_s', 0):.0f} samples/s, "
            f"waiting {100 * learner.get('wait_data_share', 0):.0f}%)  return "
            f"{'-' if ret is None else f'{ret:.1f}'}  dropped late {learner.get('dropped_late')} "
            f"stale {learner.get('dropped_stale')} invalid {learner.get('dropped_invalid', 0)}"
        )
        if "replay_size" in learner:
            lines.append(
                f"replay: {learner['replay_size']} transitions, fill {100 * learner.get('replay_fill', 0):.0f}%, "
                f"{learner.get('replay_bytes', 0) / 1e6:.1f} MB, {learner.get('grad_steps_total', 0)} gradient steps"
            )
    lines += replay_lines(body)
    return lines


def replay_lines(body: dict[str, Any]) -> list[str]:
    """One line per replay service (docs/protocol.md section 5.9): its buffer and its intake's accounting."""
    lines = []
    for peer, m in body["members"].items():
        s = m.get("stats") or {}
        if m["role"] != "replay" or "received" not in s:
            continue
        ok = s["received"] == s.get("inserted_trajectories", 0) + s.get("invalid", 0)
        lines.append(
            f"replay {peer}: {s.get('replay_size', 0)} transitions, fill {100 * s.get('replay_fill', 0):.0f}%, "
            f"{s.get('replay_bytes', 0) / 1e6:.1f} MB; received {s['received']} = inserted "
            f"{s.get('inserted_trajectories', 0)} + refused {s.get('invalid', 0)}  [{'ok' if ok else 'MISMATCH'}]; "
            f"{s.get('requests', 0)} requests, {s.get('served', 0)} transitions served"
        )
    return lines


def tree_lines(b: dict[str, Any]) -> list[str]:
    """A tree of brokers: this broker's upstream (a relay), and the relays below it with their accounting."""
    lines = []
    up = b.get("upstream")
    if up:
        state = "welcomed" if up["welcomed"] else "NOT CONNECTED"
        lines.append(
            f"relay {up['peer_id']} -> upstream {up['connect']} ({state}): in flight {up['in_flight']} of window "
            f"{up['window']}, acked {up['acked_total']}, lost {up['lost']}, sessions {up['sessions']}"
        )
    for peer, r in (b.get("relays") or {}).items():
        dropped = sum(r["dropped"].values())
        lines.append(
            f"  relay {peer}: {r['actors']} actors; received {r['received']} = forwarded {r['forwarded']} + dropped "
            f"{dropped} + in flight {r['in_flight']}; forwarded = acked {r['upstream_acked']} + in flight "
            f"{r['upstream_in_flight']} + lost {r['upstream_lost']}; read here {r['read_here']}; health warnings "
            f"{r['counters'].get('health_warnings', 0)} (zddrl status at the relay lists them)"
            f"  [{'ok' if r['accounted'] else 'MISMATCH'}]"
        )
    if b.get("relays"):
        lines.append(f"whole tree accounted: {'ok' if b.get('accounted_subtree') else 'MISMATCH'}")
    return lines


def standby_lines(b: dict[str, Any]) -> list[str]:
    """A standby pair's broker (``broker.peer``): its state, its peer and when the peer last answered."""
    pair = b.get("standby")
    if not isinstance(pair, dict):
        return []
    ago = pair.get("peer_answered_s_ago")
    heard = "never answered" if ago is None else f"answered {_number(ago, '.1f')} s ago"
    split = "  [BOTH ACTIVE: the run may be split, stop one]" if pair.get("both_active") else ""
    return [
        f"standby {pair.get('role')}: {str(pair.get('state')).upper()} for {_number(pair.get('state_s'), '.0f')} s; "
        f"peer {pair.get('peer')} {pair.get('peer_state') or '?'}, {heard}{split}"
    ]


def member_rows(body: dict[str, Any]) -> list[list[str]]:
    # The learner reports each actor's lag (its version minus the actor's newest trajectory's).
    lags = {
        k[4:]: v
        for m in body["members"].values()
        if m["role"] == "learner"
        for k, v in m.get("stats", {}).items()
        if k.startswith("lag/")
    }
    warned: dict[str, int] = {}  # the broker counts each row's warnings; older brokers listed them all
    for w in body.get("health", []):
        warned[w["member"]] = warned.get(w["member"], 0) + 1
    warned.update({peer: m["warnings"] for peer, m in body["members"].items() if m.get("warnings") is not None})
    rows = [
        [
            "member",
            "role",
            "host",
            "envs",
            "version",
            "lag",
            "msgs",
            "env_steps",
            "drops",
            "sps",
            "comm",
            "wait",
            "rss_mb",
            "warn",
            "seen_s",
        ]
    ]
    for peer, m in sorted(body["members"].items()):
        s = m.get("stats", {})
        drops = sum(v for k, v in m.items() if k.startswith("dropped_"))
        envs = m["num_envs"] or s.get("num_envs", 0)  # actors started without --envs use the run's
        # A learner shard that does not publish (rank > 0) reports its version in its stats.
        version = m["policy_version"] if m["policy_version"] >= 0 else s.get("policy_version", -1)
        rows.append(
            [
                peer,
                f"{m['role']} via {m['relay']}" if m.get("relay") else m["role"],
                f"{m['host']}:{m['pid']}",
                str(envs),
                str(version),
                str(lags.get(peer, "-")),
                str(m.get("messages", 0)),
                str(m.get("env_steps", 0)),
                str(drops),
                f"{s.get('sps', 0):.0f}",
                f"{100 * s.get('comm_share', 0):.0f}%",
                f"{100 * s.get('wait_share', s.get('wait_data_share', 0)):.0f}%",
                _number(s.get("rss_mb"), ".0f"),
                str(warned.get(peer) or "-"),
                f"{m['last_seen_s']:.1f}",
            ]
        )
    return rows


def health_rows(body: dict[str, Any]) -> list[list[str]]:
    rows = [["member", "check", "for_s", "warning"]]
    for w in body.get("health", []):
        rows.append([w["member"], w["check"], f"{w['since_s']:.0f}", w["message"]])
    return rows


def _first_line(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."


def departure_rows(body: dict[str, Any]) -> list[list[str]]:
    rows = [["member", "role", "host", "ago_s", "reason"]]
    for d in body.get("departures", []):
        rows.append([d["member"], d["role"], f"{d['host']}:{d['pid']}", f"{d['ago_s']:.0f}", _first_line(d["reason"])])
    return rows


def format_status(body: dict[str, Any]) -> str:
    parts = ["\n".join(summary_lines(body)), _table(member_rows(body))]
    health = health_rows(body)
    # Indented: a line that starts with a peer id is that member's row (scripts grep for them).
    parts.append(f"health warnings ({len(health) - 1}):\n{_table(health, '  ')}" if len(health) > 1 else "health: ok")
    departures = departure_rows(body)
    if len(departures) > 1:
        parts.append(f"departures (newest first; full reasons with --json):\n{_table(departures, '  ')}")
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------
# --watch
# ------------------------------------------------------------------------------------------------


class PlainScreen:
    """Frames as text: the terminal cleared before each one, or appended when stdout is not a terminal."""

    CLEAR = "\x1b[H\x1b[2J"

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.clear = out.isatty()

    def __enter__(self) -> PlainScreen:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.out.write("\n")
        self.out.flush()

    def show(self, header: str, body: dict[str, Any] | None, problem: str | None) -> None:
        text = "\n".join([header, *([problem] if problem else []), *([format_status(body)] if body else [])])
        self.out.write((self.CLEAR if self.clear else "") + text + ("\n" if self.clear else "\n\n"))
        self.out.flush()


class RichScreen:
    """Frames as rich tables redrawn in place (rich.live.Live)."""

    def __init__(self, out: TextIO) -> None:
        from rich.console import Console
        from rich.live import Live

        self.live = Live(console=Console(file=out), auto_refresh=False, vertical_overflow="visible")

    def __enter__(self) -> RichScreen:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)

    def show(self, header: str, body: dict[str, Any] | None, problem: str | None) -> None:
        from rich.console import Group
        from rich.text import Text

        parts: list[Any] = [Text(header, style="bold")]
        if problem:
            parts.append(Text(problem, style="bold red"))
        if body:
            parts.append(Text("\n".join(summary_lines(body)), style="dim" if problem else ""))
            parts.append(_rich_table(member_rows(body), "members", lambda r: "yellow" if r[-2] != "-" else ""))
            health = health_rows(body)
            parts.append(
                _rich_table(health, "health warnings", lambda r: "yellow")
                if len(health) > 1
                else Text("health: ok", style="green")
            )
            departures = departure_rows(body)
            if len(departures) > 1:
                parts.append(
                    _rich_table(
                        departures, "departures (newest first)", lambda r: "red" if r[-1].startswith("crashed") else ""
                    )
                )
        self.live.update(Group(*parts), refresh=True)


def _rich_table(rows: list[list[str]], title: str, style_of: Callable[[list[str]], str]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold")
    for i, name in enumerate(rows[0]):
        table.add_column(name, no_wrap=i < len(rows[0]) - 1)  # ids never folded; the last column wraps
    for row in rows[1:]:
        table.add_row(*row, style=style_of(row))
    return table


def _screen(out: TextIO, use_rich: bool | None) -> PlainScreen | RichScreen:
    if use_rich is None:
        use_rich = out.isatty()
    if use_rich:
        try:
            return RichScreen(out)
        except ImportError:  # rich is optional (pip install zddrl[watch]); plain text does the job
            pass
    return PlainScreen(out)


def watch_status(
    connect: str,
    interval_s: float,
    timeout_s: float,
    credentials: Credentials | None = None,
    *,
    out: TextIO | None = None,
    use_rich: bool | None = None,
    page: int = 1,
) -> None:
    """Show the broker's status every ``interval_s`` until Ctrl-C (a clean exit).

    A broker that does not answer within ``timeout_s`` is reported as unreachable, above the last
    status it gave; the watch keeps asking, so a restarted broker shows up again by itself."""
    out = out or sys.stdout
    last: dict[str, Any] | None = None
    last_at = 0.0
    try:
        with _screen(out, use_rich) as screen:
            while True:
                try:
                    body, why = ask_status(connect, timeout_s, credentials=credentials, page=page)
                except P.ProtocolError as exc:  # something else answers on that port; keep asking
                    body, why = None, f"not a zddrl broker answer ({exc})"
                why = why or f"no answer within {timeout_s:g} s"
                now = time.monotonic()
                if body is not None:
                    last, last_at = body, now
                problem = (
                    None
                    if body is not None
                    else (
                        f"broker unreachable at {connect}: {why}"
                        + (f"; last status {now - last_at:.0f} s ago, shown below" if last else "")
                    )
                )
                header = f"zddrl status {connect}  {time.strftime('%H:%M:%S')}  every {interval_s:g} s  (Ctrl-C quits)"
                screen.show(header, last, problem)
                time.sleep(max(interval_s, MIN_INTERVAL_S))
    except KeyboardInterrupt:
        pass
