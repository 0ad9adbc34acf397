"""The executed schedule as a picture: one SVG row per rank, forward / backward / idle.

Pure: takes :class:`~autoparallel.pipeline.runner.Event` lists (gathered from every rank, or
made from a simulation with :func:`events_from_simulation`) and writes SVG text, or the same
events as a Chrome / Perfetto trace (``write_timeline("t.json", ...)``, :func:`chrome_trace`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from xml.sax.saxutils import escape

from autoparallel.pipeline.runner import Event
from autoparallel.pipeline.schedule import COMPUTE, B, F, W
from autoparallel.pipeline.simulate import SimResult

_F_COLORS = ("#4c78a8", "#72b7b2", "#9ecae9", "#5f8dd3")  # forward, by chunk index on the mesh
_B_COLORS = ("#f58518", "#e45756", "#ffbf79", "#d67195")  # backward, by chunk index on the mesh
_W_COLORS = ("#54a24b", "#88d27a", "#b5e3a8", "#3f7f3a")  # weight gradients (zero-bubble W), by chunk index
_IDLE = "#e6e6e6"


def events_from_simulation(result: SimResult) -> list[Event]:
    """The simulated timeline as events (rank = stage mesh index, time in cost units)."""
    return [Event(e.stage, e.stage, e.action.kind, e.action.microbatch, e.action.chunk, e.start, e.end)
            for e in result.events]


def span(events: Sequence[Event]) -> tuple[float, float]:
    """Earliest start and latest end over all events."""
    return min(e.start for e in events), max(e.end for e in events)


def busy_fraction(events: Sequence[Event]) -> dict[int, float]:
    """Per rank, the fraction of the common span spent in forward or backward compute."""
    t0, t1 = span(events)
    total = (t1 - t0) or 1.0
    out: dict[int, float] = {}
    for e in events:
        out.setdefault(e.rank, 0.0)
        if e.kind in COMPUTE:
            out[e.rank] += (e.end - e.start) / total
    return out


def bubble_fraction(events: Sequence[Event]) -> float:
    """Idle (not forward/backward) fraction of the common span, averaged over ranks."""
    busy = busy_fraction(events)
    return 1.0 - sum(busy.values()) / len(busy)


def timeline_svg(events: Sequence[Event], title: str = "", width: int = 1000, row: int = 28, unit: str = "s") -> str:
    """SVG text drawing ``events``: a row per rank, F and B boxes labelled by micro-batch.

    ``unit`` names the time unit of the events ("s" for wall clock: shown in ms).
    """
    if not events:
        raise ValueError("timeline_svg: no events to draw")
    t0, t1 = span(events)
    scale = (width - 190) / ((t1 - t0) or 1.0)
    ranks = sorted({e.rank for e in events})
    stage_of = {e.rank: e.stage for e in events}
    num_stages = max(stage_of.values()) + 1
    busy = busy_fraction(events)
    top = 56
    height = top + row * len(ranks) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="18" font-size="14">{escape(title)}</text>']
    split = any(e.kind == W for e in events)
    legend = [("forward", _F_COLORS[0]), ("input grad (B)" if split else "backward", _B_COLORS[0])]
    legend += [("weight grads (W)", _W_COLORS[0])] if split else []
    legend += [("idle (bubble)", _IDLE)]
    for i, (label, color) in enumerate(legend):
        lx = 10 + i * 130
        out.append(f'<rect x="{lx}" y="28" width="14" height="12" fill="{color}"/><text x="{lx + 18}" y="38">{label}</text>')
    out.append(f'<text x="{width - 170}" y="38">mean idle {100 * (1 - sum(busy.values()) / len(busy)):.1f}%</text>')
    for i, r in enumerate(ranks):
        y = top + i * row
        out.append(f'<text x="10" y="{y + row * 0.65:.1f}">rank {r} (stage {stage_of[r]})</text>')
        out.append(f'<rect x="120" y="{y + 2}" width="{(t1 - t0) * scale:.2f}" height="{row - 4}" fill="{_IDLE}"/>')
        for e in events:
            if e.rank != r or e.kind not in COMPUTE:
                continue
            x = 120 + (e.start - t0) * scale
            w = max((e.end - e.start) * scale, 0.5)
            colors = _F_COLORS if e.kind == F else _B_COLORS if e.kind == B else _W_COLORS
            color = colors[(e.chunk // num_stages) % len(colors)]
            dur = f"{1000 * (e.end - e.start):.3g} ms" if unit == "s" else f"{e.end - e.start:g} {unit}"
            tip = f"{e.kind}{e.microbatch} chunk {e.chunk}: {dur}"
            out.append(f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row - 4}" fill="{color}" '
                       f'stroke="white" stroke-width="0.5"><title>{escape(tip)}</title></rect>')
            if w > 12:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + row * 0.65:.1f}" text-anchor="middle" fill="white">{e.microbatch}</text>')
        out.append(f'<text x="{width - 62}" y="{y + row * 0.65:.1f}">idle {100 * (1 - busy[r]):.0f}%</text>')
    total = f"{1000 * (t1 - t0):.4g} ms" if unit == "s" else f"{t1 - t0:g} {unit}"
    out.append(f'<text x="120" y="{height - 10}">time span {total}; numbers are micro-batches; lighter shades are later chunks</text>')
    out.append("</svg>")
    return "\n".join(out)


def chrome_trace(events: Sequence[Event], unit: str = "s") -> dict[str, object]:
    """``events`` in the Chrome trace event format (open in chrome://tracing or ui.perfetto.dev):
    one process per stage mesh, one thread per rank, a complete event ("X") per action named like
    ``F mb3 c1``; times in microseconds from the earliest start (``unit`` "s": wall-clock seconds,
    anything else: the simulation's cost units, drawn as microseconds)."""
    t0, _ = span(events) if events else (0.0, 0.0)
    scale = 1e6 if unit == "s" else 1.0
    out: list[dict[str, object]] = []
    for e in sorted(events, key=lambda e: (e.rank, e.start)):
        out.append({"name": f"{e.kind} mb{e.microbatch} c{e.chunk}", "cat": e.kind, "ph": "X",
                    "ts": (e.start - t0) * scale, "dur": (e.end - e.start) * scale,
                    "pid": e.stage, "tid": e.rank,
                    "args": {"microbatch": e.microbatch, "chunk": e.chunk, "kind": e.kind}})
    for stage in sorted({e.stage for e in events}):
        out.append({"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage mesh {stage}"}})
    for rank, stage in sorted({(e.rank, e.stage) for e in events}):
        out.append({"name": "thread_name", "ph": "M", "pid": stage, "tid": rank, "args": {"name": f"rank {rank}"}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_timeline(path: str, events: Sequence[Event], title: str = "", unit: str = "s") -> None:
    """Write ``events`` to ``path``: a Chrome / Perfetto trace (:func:`chrome_trace`) when
    ``path`` ends in ``.json``, else the SVG picture (:func:`timeline_svg`)."""
    with open(path, "w", encoding="utf-8") as f:
        if path.endswith(".json"):
            json.dump(chrome_trace(events, unit), f)
        else:
            f.write(timeline_svg(events, title, unit=unit))


__all__ = ["bubble_fraction", "busy_fraction", "chrome_trace", "events_from_simulation", "span", "timeline_svg",
           "write_timeline"]
