"""Pipeline parallelism across stage meshes: stage splitting and schedules as data.

* :mod:`.stage` — :class:`Stage`, :func:`split_sequential`, :func:`stages_from_annotations`
* :mod:`.by_mesh` — :func:`split_by_meshes`: stages from the meshes a forward's ``ap.shard_op`` calls name
* :mod:`.by_blocks` — :func:`split_at_blocks`: stages cut between a model's repeated blocks (an ``ap.Plan`` with a pipeline axis)
* :mod:`.schedule` — :func:`build_schedule` (FThenB, 1F1B, Interleaved1F1B, ZBH1) as per-mesh action lists
* :mod:`.split_backward` — a stage's backward as ``B`` (input gradient) and ``W`` (weight gradients)
* :mod:`.simulate` — :func:`simulate`: send/recv matching, deadlock check, ideal timeline, bubble
* :mod:`.runner` — :class:`Pipeline`: runs a schedule on real ranks, gradients accumulate
* :mod:`.timeline` — SVG timelines of executed or simulated schedules
* :mod:`.memory` — :class:`ActivationMeter`: bytes saved for backward
* :mod:`.decoder` — :func:`decoder_stages`: a transformers decoder-only LM split at its decoder layers
* :mod:`.p2p` — the two halves of a cross-mesh reshard, run apart; :mod:`.local` — one-rank stages
"""

from __future__ import annotations

from autoparallel.pipeline.by_blocks import split_at_blocks
from autoparallel.pipeline.by_mesh import run_stages, split_by_meshes
from autoparallel.pipeline.decoder import DecoderStages, decoder_stages
from autoparallel.pipeline.memory import ActivationMeter
from autoparallel.pipeline.runner import Event, Pipeline
from autoparallel.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    theoretical_bubble,
)
from autoparallel.pipeline.simulate import SimResult, simulate
from autoparallel.pipeline.stage import Stage, split_sequential, stages_from_annotations
from autoparallel.pipeline.timeline import (
    bubble_fraction,
    chrome_trace,
    events_from_simulation,
    timeline_svg,
    write_timeline,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "ActivationMeter",
    "DecoderStages",
    "Event",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Stage",
    "bubble_fraction",
    "build_schedule",
    "chrome_trace",
    "decoder_stages",
    "events_from_simulation",
    "run_stages",
    "simulate",
    "split_at_blocks",
    "split_by_meshes",
    "split_sequential",
    "stages_from_annotations",
    "theoretical_bubble",
    "timeline_svg",
    "write_timeline",
]
