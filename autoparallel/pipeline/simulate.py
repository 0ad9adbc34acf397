"""Run a schedule on paper: send/recv matching, deadlock detection, timeline and bubble.

Model: each stage mesh executes its list in order; a send posts its message and goes on; a
receive waits until the message with its key has been posted by the expected peer; ``F`` takes
``f_cost`` time units, a whole backward ``b_cost + w_cost`` (its input-gradient and weight-gradient
parts), and in a zero-bubble schedule ``B`` takes ``b_cost`` and ``W`` takes ``w_cost``. A state where no mesh can move while actions
remain is a deadlock. Because every action starts as soon as its dependencies allow, the
resulting timeline is the ideal one (no contention, free communication unless ``comm_cost``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoparallel.pipeline.schedule import COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, Schedule, ScheduleError, W


@dataclass(frozen=True, slots=True)
class TimedAction:
    """``action`` ran on stage mesh ``stage`` from ``start`` to ``end``."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Timeline of a simulated schedule with its bubble and peak in-flight micro-batches."""

    schedule: Schedule
    events: tuple[TimedAction, ...]  # compute actions only
    makespan: float
    busy: tuple[float, ...]  # compute time per stage mesh
    peak_inflight: tuple[int, ...]  # most (micro-batch, chunk) forwards awaiting backward (B)
    peak_held: tuple[int, ...]  # most (micro-batch, chunk) forwards whose activations are held (until W, else B)

    @property
    def bubble(self) -> float:
        """Idle fraction over all stage meshes: 1 - busy / (p * makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


class _State:
    def __init__(self, sched: Schedule, f_cost: float, b_cost: float, comm_cost: float, w_cost: float) -> None:
        self.s = sched
        split = sched.split_backward
        self.costs = {F: f_cost, B: b_cost if split else b_cost + w_cost, W: w_cost}
        self.comm = comm_cost
        p = sched.num_stages
        self.ptr = [0] * p
        self.clock = [0.0] * p
        self.mail: dict[tuple[str, int, int], tuple[float, int]] = {}
        self.sent: set[tuple[str, int, int]] = set()
        self.done: dict[tuple[str, int, int], float] = {}
        self.received: set[tuple[str, int, int]] = set()
        self.events: list[TimedAction] = []
        self.busy = [0.0] * p
        self.inflight = [0] * p
        self.peak = [0] * p
        self.held = [0] * p
        self.peak_held = [0] * p

    def fail(self, stage: int, a: Action, why: str) -> ScheduleError:
        return ScheduleError(f"{self.s.name} schedule, stage {stage}, action {a}: {why}")

    def try_run(self, st: int, a: Action) -> bool:
        """Run ``a`` on stage ``st`` if it can start now; False when it must wait."""
        last = self.s.num_virtual - 1
        if a.kind in COMPUTE and self.s.stage_of(a.chunk) != st:
            raise self.fail(st, a, f"chunk {a.chunk} lives on stage {self.s.stage_of(a.chunk)}")
        if a.kind in (RECV_F, RECV_B):
            key = a.key()
            if key not in self.mail:
                return False
            t, src = self.mail.pop(key)
            if src != a.peer:
                raise self.fail(st, a, f"the message comes from stage {src}, not {a.peer}")
            self.received.add(key)
            self.clock[st] = max(self.clock[st], t + self.comm)
            return True
        if a.kind in (SEND_F, SEND_B):
            key = a.key()
            src_kind = F if a.kind == SEND_F else B
            if (src_kind, a.microbatch, a.chunk) not in self.done:
                raise self.fail(st, a, f"sends before {src_kind}{a.microbatch}c{a.chunk} ran")
            if key in self.sent:
                raise self.fail(st, a, "sent twice")
            want = self.s.stage_of(key[2] if a.kind == SEND_F else key[2] - 1)
            if a.peer != want:
                raise self.fail(st, a, f"goes to stage {a.peer} but the receiving chunk is on stage {want}")
            self.sent.add(key)
            self.mail[key] = (self.clock[st], st)
            return True
        me = (a.kind, a.microbatch, a.chunk)
        if me in self.done:
            raise self.fail(st, a, "runs twice")
        if a.kind == F and a.chunk > 0 and (F, a.microbatch, a.chunk) not in self.received:
            raise self.fail(st, a, "runs before its input was received (no RECV_F before it)")
        if a.kind == W:
            if not self.s.split_backward:
                raise self.fail(st, a, f"{self.s.name} does not split its backward: no W actions")
            if (B, a.microbatch, a.chunk) not in self.done:
                raise self.fail(st, a, f"weight gradients before B{a.microbatch}c{a.chunk}")
        if a.kind == B:
            if (F, a.microbatch, a.chunk) not in self.done:
                raise self.fail(st, a, f"backward before the forward F{a.microbatch}c{a.chunk}")
            if a.chunk < last and (B, a.microbatch, a.chunk + 1) not in self.received:
                raise self.fail(st, a, "runs before its output gradient was received (no RECV_B before it)")
        start = self.clock[st]
        self.clock[st] = end = start + self.costs[a.kind]
        self.busy[st] += end - start
        self.done[me] = end
        self.events.append(TimedAction(st, a, start, end))
        if a.kind != W:
            self.inflight[st] += 1 if a.kind == F else -1
        last_use = W if self.s.split_backward else B
        if a.kind in (F, last_use):
            self.held[st] += 1 if a.kind == F else -1
        self.peak[st] = max(self.peak[st], self.inflight[st])
        self.peak_held[st] = max(self.peak_held[st], self.held[st])
        return True


def simulate(sched: Schedule, f_cost: float = 1.0, b_cost: float = 1.0, comm_cost: float = 0.0,
             w_cost: float = 0.0) -> SimResult:
    """Execute ``sched`` on paper; raise ``ScheduleError`` on deadlock, misorder or mismatch.

    ``b_cost``/``w_cost``: the input-gradient and weight-gradient parts of a backward (a schedule
    that does not split its backward runs both in ``B``)."""
    st = _State(sched, f_cost, b_cost, comm_cost, w_cost)
    lists = sched.actions
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(lists):
            while st.ptr[s] < len(acts) and st.try_run(s, acts[st.ptr[s]]):
                st.ptr[s] += 1
                progress = True
    blocked = {s: str(lists[s][st.ptr[s]]) for s in range(len(lists)) if st.ptr[s] < len(lists[s])}
    if blocked:
        raise ScheduleError(f"{sched.name} schedule deadlocks: stages wait forever at {blocked}")
    if st.mail:
        raise ScheduleError(f"{sched.name} schedule: messages sent but never received: {sorted(st.mail)}")
    m, v = sched.num_microbatches, sched.num_virtual
    for kind in (F, B, W) if sched.split_backward else (F, B):
        missing = [(mb, c) for mb in range(m) for c in range(v) if (kind, mb, c) not in st.done]
        if missing:
            raise ScheduleError(f"{sched.name} schedule never runs {kind} for (micro-batch, chunk) {missing}")
    return SimResult(sched, tuple(st.events), max(st.clock), tuple(st.busy), tuple(st.peak), tuple(st.peak_held))


__all__ = ["SimResult", "TimedAction", "simulate"]
