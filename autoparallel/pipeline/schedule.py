"""Pipeline schedules as data: one ordered list of actions per stage mesh.

A model is cut into ``V = p * v`` chunks (virtual stages); chunk ``c`` lives on stage mesh
``c % p`` (``v`` chunks per mesh, round robin as in interleaved 1F1B). Each mesh runs its list
in order; every rank of that mesh runs the same list, so collectives inside a stage line up.

Actions: ``F``/``B`` (forward/backward of micro-batch ``m`` on chunk ``c``), ``W`` (the weight
gradients of a zero-bubble schedule, whose ``B`` then computes the input's gradient only), ``SEND_F``/
``RECV_F`` (the activation crossing into chunk ``c + 1`` / into chunk ``c``), ``SEND_B``/
``RECV_B`` (the input gradient of chunk ``c`` going back / the output gradient of chunk ``c``
coming in). Sends do not block; a receive blocks until its send has been posted. Message keys
``(direction, micro-batch, receiving-side chunk)`` make matching independent of order.

Schedules are pure functions of ``(p, M, v)``; :mod:`autoparallel.pipeline.simulate` checks
them (deadlock freedom, forward before backward, counts) without processes.

Zero-bubble (``ZBH1``): each backward is split in two, ``B`` (the gradient of the chunk's input,
which the previous stage waits for) and ``W`` (the gradients of the chunk's weights, which nobody
waits for). A stage runs 1F1B's ``p - s`` forwards before its first ``B``, then ``B`` and ``F``
in turn, and puts its ``W`` off until it holds ``p`` micro-batches, the most 1F1B holds on any
stage (its first): the later stages' first weight gradients move to the end, where 1F1B waits
for the backward passes coming up the pipeline. With equal ``F``/``B``/``W`` costs the idle
fraction is ``(p - 1) / (3M + p - 1)`` (each stage idles ``p - 1`` units, 1F1B's ``3(p - 1)``)
at 1F1B's peak (a micro-batch's activations are held until its ``W``: ``p`` on every stage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from autoparallel.schedule_names import ScheduleError, schedule_name

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
KINDS = (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a stage mesh's list: ``kind`` on micro-batch ``microbatch`` of ``chunk``.

    ``peer`` is the stage mesh on the other side of a send/recv (None for compute).
    """

    kind: str
    microbatch: int
    chunk: int
    peer: int | None = None

    def key(self) -> tuple[str, int, int]:
        """Message key ``(direction, micro-batch, boundary)``; boundary = chunk after the cut."""
        boundary = {SEND_F: self.chunk + 1, RECV_F: self.chunk, SEND_B: self.chunk, RECV_B: self.chunk + 1}
        if self.kind not in boundary:
            raise ValueError(f"{self} is not a send or receive")
        return (self.kind[-1], self.microbatch, boundary[self.kind])

    def tag(self, num_chunks: int, num_microbatches: int) -> int:
        """A tag unique within one step: (direction, boundary, micro-batch) packed in an int."""
        d, m, b = self.key()
        return ((0 if d == F else 1) * num_chunks + b) * num_microbatches + m

    def __str__(self) -> str:
        s = f"{self.kind}{self.microbatch}"
        if self.chunk is not None:
            s += f"c{self.chunk}"
        if self.peer is not None:
            s += f"{'->' if self.kind.startswith('SEND') else '<-'}s{self.peer}"
        return s


@dataclass(frozen=True)
class Schedule:
    """Per-stage-mesh action lists for ``num_microbatches`` over ``num_stages * num_chunks`` chunks."""

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int  # chunks per stage mesh (v)
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_virtual(self) -> int:
        return self.num_stages * self.num_chunks

    def stage_of(self, chunk: int) -> int:
        """Stage mesh index that holds ``chunk`` (round robin; a V for ZBV)."""
        return v_stage(chunk, self.num_stages) if SCHEDULES[self.name].v_shape else chunk % self.num_stages

    def compute_order(self, stage: int) -> list[Action]:
        return [a for a in self.actions[stage] if a.kind in COMPUTE]

    @property
    def split_backward(self) -> bool:
        """Whether backwards are split into ``B`` (input gradient) and ``W`` (weight gradients)."""
        return SCHEDULES[self.name].split


    def __str__(self) -> str:
        head = f"{self.name}: {self.num_stages} stage meshes x {self.num_chunks} chunks, {self.num_microbatches} micro-batches"
        rows = [f"  stage {s}: " + " ".join(str(a) for a in acts) for s, acts in enumerate(self.actions)]
        return "\n".join([head, *rows])


# ---- compute orders ---------------------------------------------------------------------
def _fthenb(p: int, m: int, v: int, s: int) -> list[tuple[str, int, int]]:
    chunks = [j * p + s for j in range(v)]
    fwd = [(F, mb, c) for c in chunks for mb in range(m)]
    bwd = [(B, mb, c) for c in reversed(chunks) for mb in range(m)]
    return fwd + bwd


def _one_f_one_b(p: int, m: int, v: int, s: int) -> list[tuple[str, int, int]]:
    warmup = min(p - s - 1, m)
    order = [(F, mb, s) for mb in range(warmup)]
    for i in range(m - warmup):
        order += [(F, warmup + i, s), (B, i, s)]
    order += [(B, mb, s) for mb in range(m - warmup, m)]
    return order


def _interleaved(p: int, m: int, v: int, s: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved order: groups of ``p`` micro-batches sweep the chunks."""
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk(k: int, forward: bool) -> int:
        j = (k % (p * v)) // p
        return (j if forward else v - 1 - j) * p + s

    warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [(F, mb(k), chunk(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [(F, mb(warmup + k), chunk(warmup + k, True)), (B, mb(k), chunk(k, False))]
    order += [(B, mb(k), chunk(k, False)) for k in range(total - warmup, total)]
    return order


def v_stage(chunk: int, num_stages: int) -> int:
    """The stage mesh of ``chunk`` in a V (ZBV): down the meshes, then back up."""
    return chunk if chunk < num_stages else 2 * num_stages - 1 - chunk


def _zero_bubble_h1(p: int, m: int, v: int, s: int) -> list[tuple[str, int, int]]:
    """ZB-H1 on stage ``s``: 1F1B's ``p - s`` forwards before the first ``B``, then ``B`` and ``F``
    in turn; each ``W`` waits until the stage holds ``p`` micro-batches (every stage as many as
    1F1B's first), so stage ``s`` puts its first ``s`` weight gradients off into the end, where
    1F1B would wait for the later stages' backward passes."""
    out = [(F, mb, s) for mb in range(min(p - s, m))]
    n_f, n_b, n_w = len(out), 0, 0
    while n_b < m:
        out.append((B, n_b, s))
        n_b += 1
        if n_f - n_w >= p or n_f == m:
            out.append((W, n_w, s))
            n_w += 1
        if n_f < m:
            out.append((F, n_f, s))
            n_f += 1
    out.extend((W, mb, s) for mb in range(n_w, m))
    return out


def _zero_bubble_v(p: int, m: int, v: int, s: int) -> list[tuple[str, int, int]]:
    return list(_zero_bubble_v_orders(p, m)[0][s])


def _zero_bubble_v_span(p: int, m: int) -> int:
    """How many unit-cost steps the ZBV run takes, end to end."""
    return _zero_bubble_v_orders(p, m)[1]


@lru_cache(maxsize=64)
def _zero_bubble_v_orders(p: int, m: int) -> tuple[tuple[tuple[tuple[str, int, int], ...], ...], int]:
    """Every mesh's ZBV order, found by running the meshes on paper with unit costs.

    The stage that can start an action earliest goes next (ties: the lower stage). A stage runs,
    in this preference: a ``B`` whose output gradient is there (the later chunk first); else an
    ``F`` whose input is there (the later chunk first), within the memory rule; else the oldest
    ``W``. A ``W`` also fills any wait before the ``B``/``F`` it would run.

    Memory rule (chunks ``s`` and ``2p - 1 - s`` on mesh ``s``): at most ``2p`` chunk activations
    held (until ``W``) on any mesh — 1F1B's ``p`` micro-batches of a whole stage on its first mesh —
    and an ``F`` only when no ``W`` waits. Deterministic: a function of ``(p, m)``.
    """
    chunks_of = [[s, 2 * p - 1 - s] for s in range(p)]
    last = 2 * p - 1
    clock = [0] * p
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    n_f, n_b, n_w = [0] * (last + 1), [0] * (last + 1), [0] * (last + 1)
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    for _ in range(3 * m * (last + 1)):
        best: tuple[int, int, str, int, int] | None = None
        for s in range(p):
            mine = chunks_of[s]
            waiting_w = sum(n_b[c] - n_w[c] for c in mine)
            held = sum(n_f[c] - n_w[c] for c in mine)
            options: list[tuple[int, int, int, str, int, int]] = []
            for c in mine:
                if n_b[c] < n_f[c]:
                    ready = f_end[(c, n_b[c])] if c == last else b_end.get((c + 1, n_b[c]))
                    if ready is not None:
                        options.append((max(clock[s], ready), 0, -c, B, c, n_b[c]))
                if n_f[c] < m and held < 2 * p and waiting_w == 0:
                    ready = 0 if c == 0 else f_end.get((c - 1, n_f[c]))
                    if ready is not None:
                        options.append((max(clock[s], ready), 1, -c, F, c, n_f[c]))
                if n_w[c] < n_b[c]:
                    options.append((clock[s], 2, n_w[c], W, c, n_w[c]))
            if not options:
                continue
            start, _, _, kind, c, mb = min(options)
            fill = [o for o in options if o[3] == W]
            if kind != W and fill and start > clock[s]:  # a weight gradient fills the wait
                start, _, _, kind, c, mb = min(fill)
            if best is None or start < best[0]:
                best = (start, s, kind, c, mb)
        if best is None:  # (cannot happen for these rules: checked by the schedule tests)
            raise ScheduleError(f"ZBV order for {p} stages and {m} micro-batches found no next action")
        start, s, kind, c, mb = best
        clock[s] = start + 1
        orders[s].append((kind, mb, c))
        if kind == F:
            f_end[(c, mb)] = clock[s]
            n_f[c] += 1
        elif kind == B:
            b_end[(c, mb)] = clock[s]
            n_b[c] += 1
        else:
            n_w[c] += 1
    return tuple(tuple(o) for o in orders), max(clock)


def _with_comm(order: list[tuple[str, int, int]], p: int, v: int, stage_of: Callable[[int], int]) -> tuple[Action, ...]:
    """Insert the receive before and the send after each compute that crosses a chunk boundary
    (``peer``: the other side's stage mesh, this one's own where both chunks live on it)."""
    last = p * v - 1
    out: list[Action] = []
    for kind, mb, c in order:
        if kind == F:
            if c > 0:
                out.append(Action(RECV_F, mb, c, stage_of(c - 1)))
            out.append(Action(F, mb, c))
            if c < last:
                out.append(Action(SEND_F, mb, c, stage_of(c + 1)))
        elif kind == W:
            out.append(Action(W, mb, c))
        else:
            if c < last:
                out.append(Action(RECV_B, mb, c, stage_of(c + 1)))
            out.append(Action(B, mb, c))
            if c > 0:
                out.append(Action(SEND_B, mb, c, stage_of(c - 1)))
    return tuple(out)


@dataclass(frozen=True)
class _Kind:
    order: Callable[[int, int, int, int], list[tuple[str, int, int]]]
    chunked: bool  # accepts v > 1
    split: bool = False  # backward split into B (input gradient) and W (weight gradients)
    v_shape: bool = False  # two chunks per mesh in a V: chunk s and chunk 2p - 1 - s on mesh s


SCHEDULES = {
    "FThenB": _Kind(_fthenb, True),
    "1F1B": _Kind(_one_f_one_b, False),
    "Interleaved1F1B": _Kind(_interleaved, True),
    "ZBH1": _Kind(_zero_bubble_h1, False, split=True),
    "ZBV": _Kind(_zero_bubble_v, True, split=True, v_shape=True),
}
def build_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """The action lists of schedule ``name`` for ``num_stages`` meshes, micro-batches and chunks."""
    canon = schedule_name(name)
    for what, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches), ("num_chunks", num_chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{canon}: {what} must be a positive int, got {value!r}")
    kind = SCHEDULES[canon]
    if num_stages == 1 and num_chunks > 1:
        raise ScheduleError(f"{canon}: {num_chunks} chunks on a single stage mesh would send to itself; use num_chunks=1")
    if num_chunks > 1 and not kind.chunked:
        raise ScheduleError(
            f"{canon} runs one chunk per stage mesh, got {num_chunks} chunks per mesh; use Interleaved1F1B"
        )
    if kind.v_shape and num_chunks != 2:
        raise ScheduleError(
            f"{canon} runs two chunks per stage mesh, in a V (chunk s and chunk 2p - 1 - s on mesh s); got "
            f"{num_chunks} chunks per mesh"
        )
    if canon == "Interleaved1F1B" and num_microbatches % num_stages:
        raise ScheduleError(
            f"Interleaved1F1B needs the micro-batch count to be a multiple of the {num_stages} stage "
            f"meshes (at least {num_stages}); got {num_microbatches} micro-batches"
        )
    where = (lambda c: v_stage(c, num_stages)) if kind.v_shape else (lambda c: c % num_stages)
    actions = tuple(
        _with_comm(kind.order(num_stages, num_microbatches, num_chunks, s), num_stages, num_chunks, where)
        for s in range(num_stages)
    )
    return Schedule(canon, num_stages, num_microbatches, num_chunks, actions)


def theoretical_bubble(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """Idle fraction of an ideal run (equal stage costs, free communication).

    FThenB and 1F1B: ``(p - 1) / (m + p - 1)``; with ``v`` chunks per mesh (interleaved, or
    looping FThenB): ``(p - 1) / (v * m + p - 1)`` (each chunk costs ``1 / v`` of a stage),
    which assumes ``m >= p`` (with fewer micro-batches every loop over the chunks idles again).
    ZBH1 with equal ``F``, ``B`` and ``W`` costs: ``(p - 1) / (3m + p - 1)`` (each stage waits
    ``p - 1`` units of one pass in all, against 1F1B's ``p - 1`` of three), for ``m >= p``. ZBV has
    no closed form here: its simulated idle fraction with equal costs (about a fifth of 1F1B's
    for ``m >= 2p``).
    """
    canon = schedule_name(name)
    p, m, v = num_stages, num_microbatches, num_chunks
    if canon == "ZBV":  # the idle share of the unit-cost run its order comes from: 6m units of work per mesh
        return 1.0 - 6 * m / _zero_bubble_v_span(p, m)
    if SCHEDULES[canon].split:
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


__all__ = [
    "Action",
    "B",
    "F",
    "RECV_B",
    "RECV_F",
    "SCHEDULES",
    "SEND_B",
    "SEND_F",
    "W",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "schedule_name",
    "theoretical_bubble",
]
