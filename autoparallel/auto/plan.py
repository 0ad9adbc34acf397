"""``ap.Plan``: what ``ap.auto_parallel`` chose, in the semi-auto vocabulary, with its predictions.

A plan is a ``ModelPlan`` (``{module-name pattern: style}``, what ``ap.parallelize`` takes) plus
the mesh shape and axis names, the ZeRO stage of the optimizer on the data axis, the recompute
policy per module pattern, the predicted step time split into compute and communication, the
predicted memory per rank, and the runner-up plans. ``print(plan)`` shows it as a table;
``plan.save(path)`` / ``Plan.load(path)`` keep it as JSON to edit and commit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from autoparallel.mesh import ProcessMesh
from autoparallel.nn import styles as _styles
from autoparallel.nn.parallelize import ModelPlan, parallelize
from autoparallel.placement import Partial, Replicate, Shard

_STYLES = {c.__name__: c for c in (_styles.ColWiseParallel, _styles.RowWiseParallel, _styles.VocabParallelEmbedding,
                                    _styles.SequenceParallel, _styles.PrepareLayerInput, _styles.PrepareLayerOutput)}


@dataclass
class Prediction:
    """One candidate's predicted step, per rank (seconds and bytes)."""

    time_s: float
    compute_s: float
    comm_s: float
    memory_bytes: int
    collectives: int
    comm_bytes: int
    overhead_s: float = 0.0  # the framework's per-op host time
    bubble_s: float = 0.0    # a pipeline's stages waiting (fill and drain)

    def row(self) -> str:
        bubble = f", bubble {self.bubble_s * 1e3:.2f}" if self.bubble_s else ""
        return (f"{self.time_s * 1e3:9.2f} ms  (compute {self.compute_s * 1e3:.2f}, comm {self.comm_s * 1e3:.2f}, "
                f"per-op {self.overhead_s * 1e3:.2f}{bubble}; "
                f"{self.collectives} collectives, {_size(self.comm_bytes)})  memory {_size(self.memory_bytes)}")


@dataclass
class Candidate:
    """A plan the search priced: its description and prediction."""

    name: str
    prediction: Prediction
    feasible: bool = True


class PipelineRun:
    """What ``Plan.apply`` returns for a plan with a pipeline axis: ``step(x, target)`` runs the
    forward and backward of every micro-batch (``ap.pipeline.Pipeline.step``; a weight tied
    across stages then gets both copies' gradients) and returns the mean loss (on the last stage
    mesh); call the optimizer's ``step`` after it (``clip_grad_norm_`` between them clips by the
    global norm). ``pipeline`` is the ``Pipeline``."""

    def __init__(self, pipeline: Any, split: Any) -> None:
        self.pipeline = pipeline
        self._split = split

    def step(self, x: Any, target: Any, **kwargs: Any) -> Any:
        loss = self.pipeline.step(x, target, **kwargs)
        if self._split.tied:
            self._split.sync_tied_grads()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every stage's gradients by their global norm (a tied weight counted once), as one
        process clips the model's: after ``step``, before the optimizer's step, on every rank."""
        return self._split.clip_grad_norm_(max_norm, norm_type)

    @property
    def stages(self) -> list[Any]:
        return list(self.pipeline.stages)


class Plan(ModelPlan):
    """A parallel plan (see the module docstring). It is a ``ModelPlan``: ``ap.parallelize(model,
    plan.mesh, plan)`` lays the model out by it (its recompute policy included), and
    ``ap.shard_optimizer(opt, plan.optimizer_stage_for(plan.mesh))`` (or ``plan.apply(model, opt)``)
    shards the optimizer."""

    def __init__(self, styles: dict[str, Any], mesh_shape: tuple[int, ...], dim_names: list[str], zero: int = 0,
                 recompute: dict[str, str] | None = None, divisible: dict[str, int] | None = None,
                 prediction: Prediction | None = None, candidates: list[Candidate] | None = None,
                 why: str = "", model: str = "auto", pipeline: dict[str, Any] | None = None) -> None:
        super().__init__(styles, divisible or {}, model)
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.dim_names = list(dim_names)
        self.zero = int(zero)
        self.recompute = dict(recompute or {})
        self.prediction = prediction
        self.candidates = list(candidates or [])
        self.why = why
        # a pipeline axis ("pp", the mesh's first): {"stages", "microbatches", "schedule", "blocks"
        # (the nn.ModuleList of blocks it cuts), "starts" (the block each stage starts at)}
        self.pipeline = dict(pipeline) if pipeline else None

    # ---- using it ---------------------------------------------------------------------------
    @property
    def mesh(self) -> ProcessMesh:
        """The plan's mesh over ranks ``0 .. world-1`` (axes ``dim_names``)."""
        n = int(np.prod(self.mesh_shape))
        return ProcessMesh(np.arange(n).reshape(self.mesh_shape).tolist(), dim_names=self.dim_names)

    @property
    def stage_meshes(self) -> list[ProcessMesh]:
        """The pipeline's stage meshes (the slices of ``mesh`` along ``pp``); ``[mesh]`` without one."""
        mesh = self.mesh
        if "pp" not in mesh.dim_names:
            return [mesh]
        return [mesh.get_mesh_with_dim("pp", k) for k in range(mesh.shape[mesh.dim_names.index("pp")])]

    @property
    def optimizer_stage(self) -> int:
        """The ZeRO stage on the data axis: 0 (plain data parallel), 1, 2 or 3."""
        return self.zero

    def optimizer_stage_for(self, mesh: ProcessMesh) -> Any:
        """The ``ap.ShardingStageN(mesh, "dp")`` of this plan, or None for stage 0 / no data axis."""
        from autoparallel.optim.stages import ShardingStage1, ShardingStage2, ShardingStage3
        if not self.zero or "dp" not in mesh.dim_names:
            return None
        return {1: ShardingStage1, 2: ShardingStage2, 3: ShardingStage3}[self.zero](mesh, "dp")

    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              mesh: ProcessMesh | None = None, loss: Any = None) -> tuple[Any, Any]:
        """Lay ``model`` out by the plan (``ap.parallelize``) and wrap ``optimizer``
        (``ap.shard_optimizer`` with the plan's ZeRO stage); returns ``(model, optimizer)``.

        With a pipeline axis it returns ``(pipe, optimizer)`` instead: ``pipe`` is an
        ``ap.pipeline.Pipeline`` over the plan's stages (``ap.pipeline.split_at_blocks``), whose
        ``pipe.step(x, target)`` runs forward and backward of every micro-batch with ``loss``
        (required: ``loss(output, target)``) and returns the mean loss; feed ``x`` on the first
        stage mesh and ``target`` on the last (``plan.stage_meshes``)."""
        mesh = mesh if mesh is not None else self.mesh
        if self.pipeline:
            return self._apply_pipeline(model, optimizer, mesh, loss)
        parallelize(model, mesh, self, recompute=self.recompute or None)
        if optimizer is not None:
            from autoparallel.optim.sharded import shard_optimizer
            optimizer = shard_optimizer(optimizer, self.optimizer_stage_for(mesh))
        return model, optimizer

    def _apply_pipeline(self, model: nn.Module, optimizer: Any, mesh: ProcessMesh, loss: Any) -> tuple[Any, Any]:
        from autoparallel.pipeline import Pipeline
        from autoparallel.pipeline.by_blocks import split_at_blocks
        from autoparallel.pipeline.decoder import decoder_stages, is_decoder

        pipe = self.pipeline or {}
        if "pp" not in mesh.dim_names:
            raise ValueError(f"ap.Plan.apply: this plan has a pipeline axis; pass a mesh with a 'pp' axis, got {mesh}")
        meshes = [mesh.get_mesh_with_dim("pp", k) for k in range(mesh.shape[mesh.dim_names.index("pp")])]
        starts = [int(s) for s in pipe["starts"]]
        if is_decoder(model):  # a transformers decoder: its own loss, a tied head kept in sync
            split = decoder_stages(model, meshes, split_points=starts[1:], plan=dict(self) or None)
            if self.recompute:
                from autoparallel.memory.recomputation import recompute
                from autoparallel.nn.parallelize import match_recompute
                for module, policy in match_recompute(model, self.recompute):
                    recompute(module, policy)
        else:
            if loss is None or not callable(loss):
                raise ValueError("ap.Plan.apply: this plan has a pipeline axis; pass loss= (called as "
                                 "loss(output, target) on the last stage, per micro-batch)")
            split = split_at_blocks(model, meshes, str(pipe["blocks"]), starts, dict(self) or None,
                                    self.recompute or None, loss)
        loss = loss or split.loss_fn
        assert loss is not None  # (checked above, or the decoder's own)
        runner = Pipeline(split.stages, loss, num_microbatches=int(pipe["microbatches"]),
                          schedule=str(pipe.get("schedule", "1F1B")))
        if optimizer is not None:
            for (ma, a), (mb, b) in split.tied:  # a weight's copy on a later stage steps with its original
                original, twin = getattr(ma, a), getattr(mb, b)
                group = next((g for g in optimizer.param_groups if any(q is original for q in g["params"])), None)
                if group is None:
                    optimizer.add_param_group({"params": [twin]})
                else:
                    group["params"].append(twin)
            from autoparallel.optim.sharded import shard_optimizer
            optimizer = shard_optimizer(optimizer, self.optimizer_stage_for(mesh))
        return PipelineRun(runner, split), optimizer

    # ---- reading it ---------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"ap.Plan: mesh {dict(zip(self.dim_names, self.mesh_shape))}, ZeRO stage {self.zero}, "
                 f"recompute {self.recompute or 'none'}"]
        if self.pipeline:
            p = self.pipeline
            lines.append(f"  pipeline: {p['stages']} stages ({p['schedule']}, {p['microbatches']} micro-batches), "
                         f"{p['blocks']} cut at blocks {list(p['starts'])}")
        if self.prediction is not None:
            lines.append(f"  predicted per rank: {self.prediction.row()}")
        if self:
            lines.append("  module pattern -> style:")
            width = max(len(k) for k in self)
            lines += [f"    {k.ljust(width)}  {v!r}" for k, v in self.items()]
        else:
            lines.append("  no module is split (every parameter whole on each rank of its data-parallel group)")
        if self.why:
            lines.append(f"  why: {self.why}")
        if self.candidates:
            lines.append("  candidates (best first):")
            for c in self.candidates[:8]:
                mark = "" if c.feasible else "  [over the memory budget]"
                lines.append(f"    {c.name:<34} {c.prediction.row()}{mark}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Plan(mesh={dict(zip(self.dim_names, self.mesh_shape))}, zero={self.zero}, styles={dict(self)!r})"

    # ---- keeping it ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "mesh_shape": list(self.mesh_shape), "dim_names": self.dim_names, "zero": self.zero,
            "recompute": self.recompute, "divisible": self.divisible, "model": self.model,
            "styles": {k: _style_json(v) for k, v in self.items()},
            "prediction": None if self.prediction is None else vars(self.prediction),
            "why": self.why, "pipeline": self.pipeline,
        }

    def save(self, path: str) -> None:
        """Write the plan as JSON (edit it by hand; ``Plan.load`` reads it back)."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        try:
            styles = {k: _style_from_json(v) for k, v in data.get("styles", {}).items()}
            pred = data.get("prediction")
            return cls(styles, tuple(data["mesh_shape"]), list(data["dim_names"]), int(data.get("zero", 0)),
                       dict(data.get("recompute") or {}), dict(data.get("divisible") or {}),
                       Prediction(**pred) if pred else None, None, str(data.get("why", "")), str(data.get("model", "auto")),
                       data.get("pipeline"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"ap.Plan.load: not a plan ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path: str) -> Plan:
        """Read a plan written by ``Plan.save`` (or by hand in the same form)."""
        with open(path) as f:
            return cls.from_json(json.load(f))


def _placement_json(p: Any) -> Any:
    if isinstance(p, (list, tuple)):
        return [_placement_json(x) for x in p]
    if p is None:
        return None
    if isinstance(p, Shard):
        return {"Shard": p.dim}
    if isinstance(p, Partial):
        return {"Partial": p.reduce_type}
    if isinstance(p, Replicate):
        return {"Replicate": None}
    raise TypeError(f"ap.Plan: cannot save layout {p!r}")


def _placement_from_json(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, list):
        return [_placement_from_json(v) for v in x]
    (kind, arg), = x.items()
    return {"Shard": lambda: Shard(arg), "Partial": lambda: Partial(arg), "Replicate": lambda: Replicate()}[kind]()


def _style_json(style: Any) -> dict[str, Any]:
    name = type(style).__name__
    if name not in _STYLES:
        raise TypeError(f"ap.Plan.save: style {style!r} is not one of {sorted(_STYLES)}")
    args = dict(vars(style))
    if name == "VocabParallelEmbedding":
        args = {"output_layout": args.get("output_layout")}
    for k in ("output_layout", "input_layouts", "output_layouts"):
        if k in args:
            args[k] = _placement_json(args[k])
    if "kwarg_layouts" in args:
        args["kwarg_layouts"] = {k: _placement_json(v) for k, v in args["kwarg_layouts"].items()}
    return {"style": name, "args": args}


def _style_from_json(x: dict[str, Any]) -> Any:
    name = x["style"]
    if name not in _STYLES:
        raise ValueError(f"ap.Plan.load: unknown style {name!r} (known: {sorted(_STYLES)})")
    args = dict(x.get("args") or {})
    for k in ("output_layout", "input_layouts", "output_layouts"):
        if k in args:
            args[k] = _placement_from_json(args[k])
    if "kwarg_layouts" in args:
        args["kwarg_layouts"] = {k: _placement_from_json(v) for k, v in args["kwarg_layouts"].items()}
    return _STYLES[name](**args)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_bytes(budget: Any) -> int | None:
    """``"70GiB"``, ``"512MB"``, ``2**30`` -> bytes; None -> None."""
    if budget is None:
        return None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return int(budget)
    if isinstance(budget, str):
        s = budget.strip().replace(" ", "")
        units = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "TB": 10**12, "GB": 10**9,
                 "MB": 10**6, "KB": 10**3, "B": 1}
        for u, f in units.items():
            if s.endswith(u):
                try:
                    return int(float(s[: -len(u)]) * f)
                except ValueError:
                    break
    raise ValueError(f"ap.auto_parallel: memory_budget {budget!r} is not a size like '70GiB', '512MB' or a number of bytes")


__all__ = ["Candidate", "PipelineRun", "Plan", "Prediction", "parse_bytes"]
