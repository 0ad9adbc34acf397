"""``ap.Engine``: Paddle's static semi-auto training driver, as a thin layer over the dynamic API.

Everything the Engine does is a dynamic-API call a script could make itself (docs/engine.md):

- layout: a model whose parameters are plain after a probe forward (one zero sample, eval mode,
  no gradients — annotations written in ``forward`` lay their parameters out there) becomes data
  parallel over the whole world: ``ap.shard_layer(model, ProcessMesh(range(world), ["dp"]))``.
  A model holding DistTensors keeps their mesh and layout;
- the batch: ``Shard(0)`` on the mesh axis ``"dp"`` (``ap.shard_dataloader`` /
  ``ap.shard_tensor``), ``Replicate`` on a mesh without one;
- ``strategy.sharding`` -> ``ap.ShardingStage{1,2,3}(mesh, "dp")``, ``strategy.amp`` ->
  ``ap.MixedPrecision``, both given to ``ap.shard_optimizer``; float16 also scales the loss
  with ``ap.GradScaler`` (``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update``); ``strategy.recompute`` ->
  ``ap.recompute(model)``; ``strategy.gradient_merge`` -> the optimizer
  steps every ``k_steps`` runs with the mean of their gradients;
- ``strategy.pipeline`` -> ``ap.pipeline.Pipeline`` over the stages the forward's
  ``ap.shard_op(layer, sub_mesh)`` calls name (``pipeline.split_by_meshes``: the forward traced and
  cut at the mesh changes), ``accumulate_steps`` micro-batches of ``micro_batch_size`` samples
  each, ``schedule_mode``; inputs arrive on the first stage's mesh, labels on the last one's;
  the loss and ``ap.metrics`` (updated per micro-batch on the last stage) are sent to every rank;
  eval and predict run the stages one after another on the whole batch;
- ``save``/``load``: ``ap.save_state_dict``/``ap.load_state_dict`` of the model and optimizer.

- the step: ``ap.to_static(model, loss=loss, optimizer=optimizer, strategy=strategy,
  outputs=True)`` (the model's outputs come back for the metrics), with ``accumulate_steps`` the
  merge's ``k_steps``: each input signature's first run is eager, the second captured, later
  ones replay the program. Two cases run eagerly, op by op on DistTensors: pipelines (the
  ``Pipeline`` runs its schedule) and float16 (``ap.GradScaler`` steps outside a program); so do
  batches with more than one label tensor (a captured step takes one).

Every decision reads metadata every rank sees alike, so a bad configuration raises the same
error on every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from autoparallel import runtime
from autoparallel.api import dtensor_from_local, reshard, shard_tensor
from autoparallel.auto import Plan, auto_parallel, parallelize
from autoparallel.checkpoint import checkpoint_keys, init_optimizer_state, load_state_dict, save_state_dict
from autoparallel.checkpoint.flat import flatten
from autoparallel.compat import tree_flatten, tree_unflatten
from autoparallel.data import ShardDataloader, shard_dataloader
from autoparallel.engine.dtensor import DistTensor
from autoparallel.memory import recompute
from autoparallel.mesh import ProcessMesh
from autoparallel.nn.shard_layer import shard_layer
from autoparallel.optim import (
    GradScaler,
    MixedPrecision,
    ShardedOptimizer,
    ShardingStage1,
    ShardingStage2,
    ShardingStage3,
    shard_optimizer,
)
from autoparallel.pipeline import Pipeline, run_stages, split_by_meshes
from autoparallel.pipeline.stage import Stage
from autoparallel.placement import Placement, Replicate, Shard
from autoparallel.static.inputs import InputSpec, as_specs
from autoparallel.static.metrics import whole
from autoparallel.static.model import DistModel, to_static
from autoparallel.static.progress import Summary, progress
from autoparallel.static.strategy import Strategy

MODES = ("train", "eval", "predict")
_STAGES = {1: ShardingStage1, 2: ShardingStage2, 3: ShardingStage3}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"ap.Engine: mode must be one of {MODES}, got {mode!r}")
    return str(mode)


def _float(value: Any) -> float:
    t = whole(value)
    return float(t.detach().reshape(()).item()) if isinstance(t, torch.Tensor) else float(t)


def _detached(out: Any) -> Any:
    """The model's outputs with every tensor detached (a tensor, or a nest of them such as a
    ``transformers`` ``ModelOutput``), as the metrics see them."""
    leaves, tree = tree_flatten(out)
    return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in leaves], tree)


class _Relaid:
    """Batches split over a 1-d world mesh, relabelled (no data moves) onto the 2-d hybrid
    sharding mesh ``["dp", "sharding"]`` as ``[Shard(0), Shard(0)]``: rank ``r`` holds chunk
    ``r`` of the batch under both layouts (the 2-d mesh numbers its ranks row-major)."""

    def __init__(self, loader: ShardDataloader, mesh: ProcessMesh) -> None:
        self.loader, self.mesh = loader, mesh

    def _relaid(self, value: Any) -> Any:
        if isinstance(value, DistTensor):
            return dtensor_from_local(value.to_local(), self.mesh, [Shard(0), Shard(0)], tuple(value.shape))
        if isinstance(value, (list, tuple)):
            return type(value)(self._relaid(v) for v in value)
        if isinstance(value, Mapping):
            return {k: self._relaid(v) for k, v in value.items()}
        return value

    def __iter__(self) -> Iterator[Any]:
        return (self._relaid(batch) for batch in self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class EngineLoader:
    """What ``Engine.dataloader`` returns: call it (or iterate it) for one pass over the data.

    Each pass resets the Engine's metrics, so ``run`` reports them over the pass so far."""

    def __init__(self, loader: ShardDataloader | _Relaid, epochs: int, on_pass: Callable[[], None]) -> None:
        self.loader, self.epochs, self._on_pass = loader, epochs, on_pass

    def __call__(self) -> Iterator[Any]:
        return iter(self)

    def __iter__(self) -> Iterator[Any]:
        self._on_pass()
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class Engine:
    """Train, evaluate and predict with ``model``, ``loss``, ``optimizer`` and ``metrics`` laid out
    by ``strategy`` (an ``ap.Strategy``; default: data parallel over the whole world).

    ``metrics``: an ``ap.metrics`` metric (``compute``/``update``/``accumulate``/``reset``/
    ``name``), any callable ``(outputs, labels) -> dict`` of numbers, or a list of them.
    """

    def __init__(self, model: torch.nn.Module, loss: Callable[..., Any] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, metrics: Any = None,
                 strategy: Strategy | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ap.Engine: model must be a torch.nn.Module, got {type(model).__name__}")
        if loss is not None and not callable(loss):
            raise TypeError(f"ap.Engine: loss must be callable, got {type(loss).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ap.Engine: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"ap.Engine: strategy must be an ap.Strategy, got {type(strategy).__name__}")
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.strategy = strategy if strategy is not None else Strategy()
        self.metrics = self._check_metrics(metrics)
        self.mesh: ProcessMesh | None = None       # set by the first prepare/dataloader/run
        self.data_axis: str | None = None          # the mesh axis the batch is split on
        self._specs: tuple[list[InputSpec] | None, list[InputSpec] | None] = (None, None)
        self._micro = 0                            # runs since the last optimizer step
        self._stages: list[Stage] | None = None    # Strategy.pipeline: the stages, in forward order
        self._pipe: Pipeline | None = None
        self.scaler: GradScaler | None = None      # Strategy.amp with float16: the loss scaler
        self.plan: Plan | None = None              # Strategy.auto_mode="full": the plan ap.auto_parallel chose
        self._program: DistModel | None = None     # the captured step (outside pipelines and float16)
        self._said_eager = False                   # warned once that a batch's labels keep it eager
        self._check_strategy()

    # ---- configuration -------------------------------------------------------------------------
    @staticmethod
    def _check_metrics(metrics: Any) -> list[Any]:
        items = [] if metrics is None else list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]
        for m in items:
            paddle_style = all(callable(getattr(m, a, None)) for a in ("update", "accumulate", "reset", "name"))
            if not paddle_style and not callable(m):
                raise TypeError(f"ap.Engine: a metric must have update/accumulate/reset/name (ap.metrics) "
                                f"or be a callable (outputs, labels) -> dict, got {type(m).__name__}")
        return items

    def _check_strategy(self) -> None:
        s = self.strategy
        if s.auto_mode == "full":
            if s.pipeline.enable:
                raise NotImplementedError("ap.Engine: Strategy.auto_mode='full' does not search pipeline splits; "
                                          "switch Strategy.pipeline off, or lay the stages out with ap.shard_op")
            if self.loss is None:
                raise ValueError("ap.Engine: Strategy.auto_mode='full' prices the training step: give the Engine a loss")
        if s.pipeline.enable:
            if s.sharding.enable:
                raise NotImplementedError("ap.Engine: Strategy.pipeline with Strategy.sharding is not built; "
                                          "use one of them (or ap.pipeline.Pipeline with ap.shard_optimizer)")
            if s.amp.enable and s.amp.dtype == "float16":
                raise NotImplementedError("ap.Engine: Strategy.pipeline with float16 (loss scaling) is not built; "
                                          "use Strategy.amp.dtype = 'bfloat16'")
            if any(not hasattr(m, "accumulate") for m in self.metrics):
                raise ValueError("ap.Engine: under Strategy.pipeline the metrics must be ap.metrics objects (their "
                                 "names are known on every stage); a callable metric runs on the last stage only")
        world = runtime.get_world_size()
        degree = s.sharding.degree
        if s.sharding.enable and degree is not None and world % degree:
            raise ValueError(f"ap.Engine: Strategy.sharding.degree {degree} does not divide the world of "
                             f"{world} processes")

    @property
    def merge_steps(self) -> int:
        """Runs per optimizer step: ``gradient_merge.k_steps`` when enabled, else ``accumulate_steps``."""
        gm = self.strategy.gradient_merge
        return gm.k_steps if gm.enable else self.strategy.accumulate_steps

    # ---- laying out (once) ------------------------------------------------------------------------
    def prepare(self, inputs_spec: Any = None, labels_spec: Any = None, mode: str = "train") -> None:
        """Record the input and label specs and lay the model and optimizer out (Paddle's prepare).

        ``inputs_spec``/``labels_spec``: an ``ap.InputSpec`` or a list; batches are checked
        against them (``None`` dims: any size). Without them a batch is ``(input, *labels)``."""
        _mode(mode)
        specs = (as_specs(inputs_spec, "ap.Engine.prepare: inputs_spec"),
                 as_specs(labels_spec, "ap.Engine.prepare: labels_spec"))
        self._specs = specs
        self._setup(lambda: [s.sample() for s in specs[0]] if specs[0] else None)

    def _setup(self, sample: Callable[[], list[Any] | None]) -> None:
        if self.mesh is not None:
            return
        if self.strategy.pipeline.enable:
            self._setup_pipeline()
            return
        model = self.model
        if self.strategy.auto_mode == "full" and not any(isinstance(p, DistTensor) for p in model.parameters()):
            self._auto_layout()
        if not any(isinstance(p, DistTensor) for p in model.parameters()):
            inputs = sample()
            if inputs is not None:
                self._probe(inputs)
        meshes = {p.process_mesh for p in model.parameters() if isinstance(p, DistTensor)}
        if len(meshes) > 1:
            raise NotImplementedError(
                f"ap.Engine: the model's parameters live on {len(meshes)} meshes; pipelines are not built "
                "by the Engine yet: use ap.pipeline.Pipeline (docs/pipeline.md)")
        mesh = meshes.pop() if meshes else self._default_mesh()
        if any(not isinstance(p, DistTensor) for p in model.parameters()):
            shard_layer(model, mesh)  # plain parameters: Replicate on every axis
        self.data_axis = "dp" if "dp" in mesh.dim_names else None
        stage = self._sharding(mesh)
        if stage is None and self.plan is not None:
            stage = self.plan.optimizer_stage_for(mesh)
        if self.strategy.recompute.enable:
            recompute(model)
        amp = self.strategy.amp
        precision = MixedPrecision(_DTYPES[amp.dtype]) if amp.enable else None
        if self.optimizer is not None and not isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer = shard_optimizer(self.optimizer, stage, mixed_precision=precision)
        elif (stage is not None or precision is not None) and self.optimizer is not None:
            raise ValueError("ap.Engine: the optimizer is already an ap.shard_optimizer; give the plain "
                             "optimizer so Strategy.sharding / Strategy.amp can wrap it")
        if amp.enable and amp.dtype == "float16":
            device = "cuda" if any(p.is_cuda for p in model.parameters()) else "cpu"
            self.scaler = GradScaler(device, init_scale=amp.init_loss_scaling)
        self.mesh = mesh

    def _auto_layout(self) -> None:
        """``Strategy.auto_mode="full"``: ``ap.auto_parallel`` searches the plan on one batch of the
        prepared specs (a dim of any size: 2 x world rows, else 16) and lays the model out by it."""
        inputs, labels = self._specs
        if not inputs or not labels:
            raise ValueError("ap.Engine: Strategy.auto_mode='full' searches the plan on the prepared shapes: call "
                             "engine.prepare(inputs_spec=..., labels_spec=...) first")
        if len(labels) != 1:
            raise NotImplementedError("ap.Engine: Strategy.auto_mode='full' supports one label tensor")
        world = runtime.get_world_size()

        def example(spec: InputSpec) -> torch.Tensor:
            shape = [(2 * world if i == 0 else 16) if d is None else d for i, d in enumerate(spec.shape)]
            return torch.zeros(shape, dtype=spec.dtype)

        plan = auto_parallel(self.model, world=world, example=(*[example(s) for s in inputs], example(labels[0])),
                             loss=self.loss, optimizer=self.optimizer if self.optimizer is not None else "adamw")
        parallelize(self.model, plan.mesh, plan)
        self.plan = plan
        if runtime.get_rank() == 0:
            print(plan)

    def _setup_pipeline(self) -> None:
        """Stages from the forward's meshes, the Pipeline, the optimizer (``Strategy.pipeline``)."""
        pp = self.strategy.pipeline
        stages = split_by_meshes(self.model)
        if self.strategy.recompute.enable:
            for st in stages:
                recompute(st.module)
        self._pipe = Pipeline(stages, self._pipeline_loss, num_microbatches=pp.accumulate_steps,
                              schedule=pp.schedule_mode)
        self._stages = stages
        amp = self.strategy.amp
        precision = MixedPrecision(_DTYPES[amp.dtype]) if amp.enable else None
        if self.optimizer is not None and not isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer = shard_optimizer(self.optimizer, None, mixed_precision=precision)
        self.mesh = stages[0].mesh
        self.data_axis = "dp" if "dp" in self.mesh.dim_names else None

    def _pipeline_loss(self, out: Any, *labels: Any) -> Any:
        """The loss of one micro-batch on the last stage; ``ap.metrics`` see its output there."""
        assert self.loss is not None
        loss = self.loss(out, *labels)
        if torch.is_grad_enabled():  # (not the pipeline's no-grad pass finding its layouts)
            self._update_metrics(_detached(out), list(labels))
        return loss

    def _check_micro_batches(self, rows: int) -> None:
        pp = self.strategy.pipeline
        if rows != pp.micro_batch_size * pp.accumulate_steps:
            raise ValueError(
                f"ap.Engine: Strategy.pipeline runs {pp.accumulate_steps} micro-batches (accumulate_steps) of "
                f"micro_batch_size {pp.micro_batch_size}, {pp.micro_batch_size * pp.accumulate_steps} samples, "
                f"but the batch holds {rows}: make batch_size = micro_batch_size x accumulate_steps")

    def _probe(self, inputs: list[Any]) -> None:
        """Run the forward once on zeros, so annotations in ``forward`` lay parameters out."""
        was = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                self.model(*inputs)
        finally:
            self.model.train(was)

    def _default_mesh(self) -> ProcessMesh:
        """Data parallel over the world: a 1-d mesh ``"dp"``; with ``Strategy.sharding.degree``
        below the world, a 2-d mesh ``["dp", "sharding"]`` (groups of ``degree`` consecutive
        ranks share the sharded states, the groups replicate them: hybrid sharding)."""
        world = runtime.get_world_size()
        s = self.strategy.sharding
        if s.enable and s.degree is not None and s.degree < world:
            return ProcessMesh(torch.arange(world).reshape(world // s.degree, s.degree).tolist(),
                               dim_names=["dp", "sharding"])
        return ProcessMesh(list(range(world)), dim_names=["dp"])

    @property
    def _hybrid(self) -> bool:
        return self.mesh is not None and self.mesh.dim_names == ["dp", "sharding"] and self._stages is None

    def _sharding(self, mesh: ProcessMesh) -> Any:
        s = self.strategy.sharding
        if not s.enable:
            return None
        if self.data_axis is None:
            raise ValueError(f"ap.Engine: Strategy.sharding shards along the data-parallel axis 'dp', and the "
                             f"model's mesh {mesh!r} has none")
        if mesh.dim_names == ["dp", "sharding"]:  # hybrid (``_default_mesh``)
            return _STAGES[s.stage](mesh, "sharding")
        size = mesh.get_dim_size("dp")
        if s.degree is not None and s.degree != size:
            raise ValueError(f"ap.Engine: Strategy.sharding.degree {s.degree} differs from the data-parallel "
                             f"degree {size} (the 'dp' axis of {mesh!r}); sharding a part of the data-parallel "
                             "ranks (hybrid sharding) is built for the Engine's own data-parallel layout only (a "
                             "model without annotations): set degree to None or to the 'dp' size")
        return _STAGES[s.stage](mesh, "dp")

    # ---- batches ----------------------------------------------------------------------------
    def _laid_mesh(self) -> ProcessMesh:
        assert self.mesh is not None, "laid out by _setup first"
        return self.mesh

    def _placements(self, mesh: ProcessMesh | None = None) -> list[Placement]:
        """The batch's layout: split on ``"dp"`` (and on ``"sharding"`` under hybrid sharding)."""
        mesh = mesh or self._laid_mesh()
        return [Shard(0) if n in ("dp", "sharding") and self.data_axis else Replicate() for n in mesh.dim_names]

    def _label_mesh(self) -> ProcessMesh:
        """Where labels go: the last stage's mesh under a pipeline (the loss runs there), else the model's."""
        return self._stages[-1].mesh if self._stages else self._laid_mesh()

    def _split(self, data: Any, mode: str) -> tuple[list[Any], list[Any]]:
        """(inputs, labels) of a batch: a dict (keys: the specs' names), a list/tuple or one input."""
        ins, labs = self._specs
        if isinstance(data, Mapping):
            named = (ins or []) + ([] if mode == "predict" else labs or [])
            if not named or any(s.name is None for s in named):
                raise ValueError("ap.Engine: a dict batch needs prepare() with named InputSpecs (the keys)")
            missing = [s.name for s in named if s.name not in data]
            if missing:
                raise ValueError(f"ap.Engine: batch keys {list(data)} lack {missing}")
            return [data[s.name] for s in ins or []], [data[s.name] for s in labs or []] if mode != "predict" else []
        items = list(data) if isinstance(data, (list, tuple)) else [data]
        n = len(ins) if ins else (len(items) - len(labs) if labs and mode != "predict" else 1)
        if n < 1 or n > len(items):
            raise ValueError(f"ap.Engine: a batch of {len(items)} items for {n} inputs")
        return items[:n], items[n:]

    def _batch(self, data: Any, mode: str) -> tuple[list[Any], list[Any]]:
        inputs, labels = self._split(data, mode)
        self._setup(lambda: [torch.zeros((1, *t.shape[1:]), dtype=t.dtype) if isinstance(t, torch.Tensor) else t
                             for t in inputs])
        for specs, values, what in ((self._specs[0], inputs, "input"), (self._specs[1], labels, "label")):
            for i, (spec, t) in enumerate(zip(specs or [], values)):
                spec.check(t, f"ap.Engine: {what} {i}")
        def lay(t: Any, mesh: ProcessMesh) -> Any:
            if isinstance(t, torch.Tensor) and not isinstance(t, DistTensor):
                return shard_tensor(t, mesh, self._placements(mesh))
            return t
        return [lay(t, self._laid_mesh()) for t in inputs], [lay(t, self._label_mesh()) for t in labels]

    def dataloader(self, dataset: Dataset[Any], batch_size: int = 1, epochs: int = 1, shuffle: bool = False,
                   mode: str = "train", collate_fn: Callable[[list[Any]], Any] | None = None,
                   num_workers: int = 0, seed: int = 0) -> EngineLoader:
        """Batches of ``batch_size`` samples (the global batch), laid out for the strategy; each rank
        loads only its rows. Call the result once per pass; a short last batch is dropped.
        ``shuffle`` draws the order from a generator seeded with ``seed``, alike on every rank."""
        _mode(mode)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"ap.Engine.dataloader: batch_size must be an int >= 1, got {batch_size!r}")
        collate = collate_fn or default_collate
        self._setup(lambda: self._sample_of(collate([dataset[0]]), mode))
        generator = torch.Generator().manual_seed(seed) if shuffle else None
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=True, collate_fn=collate,
                            num_workers=num_workers, generator=generator)
        if self._hybrid:  # each rank loads its rows of the whole world's split, laid out on the 2-d mesh
            world = ProcessMesh(list(range(runtime.get_world_size())), dim_names=["dp"])
            return EngineLoader(_Relaid(shard_dataloader(loader, world, shard_dims="dp"), self._laid_mesh()), epochs,
                                self._reset_metrics)
        if self._stages is None:
            return EngineLoader(shard_dataloader(loader, self._laid_mesh(), shard_dims=self.data_axis), epochs,
                                self._reset_metrics)
        if mode == "train":
            self._check_micro_batches(batch_size)
        # a pipeline: inputs on the first stage's mesh, labels on the last one's
        sample = collate([dataset[0]])
        inputs, labels = self._split(sample, mode)
        meshes = [self._laid_mesh()] * len(inputs) + [self._label_mesh()] * len(labels)
        keys = None
        if isinstance(sample, Mapping):
            keys = [str(s.name) for s in (self._specs[0] or []) + ([] if mode == "predict" else self._specs[1] or [])]
        dims = ["dp" if "dp" in m.dim_names and self.data_axis else None for m in meshes]
        return EngineLoader(shard_dataloader(loader, meshes, input_keys=keys, shard_dims=dims), epochs, self._reset_metrics)

    def _sample_of(self, batch: Any, mode: str) -> list[Any]:
        inputs, _ = self._split(batch, mode)
        return [torch.zeros_like(t) if isinstance(t, torch.Tensor) else t for t in inputs]

    # ---- one step ----------------------------------------------------------------------------
    def run(self, data: Any, mode: str = "train") -> dict[str, Any]:
        """One batch: train (forward, loss, backward, optimizer step every ``merge_steps`` runs),
        eval (forward and loss) or predict (forward). Returns, on every rank, ``{"loss": float, <each
        metric name>: float}`` — metrics of ``ap.metrics`` accumulated since their last reset (each
        pass of an ``Engine.dataloader``) — or ``{"outputs": the full output}`` for predict."""
        mode = _mode(mode)
        inputs, labels = self._batch(data, mode)
        if self._pipe is not None:
            return self._run_pipeline(inputs, labels, mode)
        program = self._captured()
        if mode == "predict":
            self.model.eval()
            if program is not None:
                return {"outputs": whole(program.predict()(*inputs))}
            with torch.no_grad():
                return {"outputs": whole(self.model(*inputs))}
        loss_fn = self._loss_for(mode)
        if program is not None and len(labels) != 1 and not self._said_eager:
            self._said_eager = True
            warnings.warn(f"autoparallel: ap.Engine: a batch with {len(labels)} label tensors runs eagerly (op by op): "
                          "a captured step takes one label", stacklevel=2)
        if program is not None and len(labels) == 1:
            program = program.train() if mode == "train" else program.eval()
            loss, out = program(*inputs, labels[0])
        elif mode == "train":
            self.model.train()
            out = self.model(*inputs)
            loss = loss_fn(out, *labels)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            self._trained()
        else:
            self.model.eval()
            with torch.no_grad():
                out = self.model(*inputs)
                loss = loss_fn(out, *labels)
        logs = {"loss": _float(loss.detach())}
        logs.update(self._measure(_detached(out), labels))
        return logs

    def _captured(self) -> DistModel | None:
        """The step as ``ap.to_static`` captures it (built at the first run); None where the
        Engine runs eagerly: under a pipeline and with float16's loss scaler."""
        if self._pipe is not None or self.scaler is not None:
            return None
        if self._program is None:
            strategy = Strategy(self.strategy.to_dict())
            strategy.accumulate_steps = self.merge_steps  # the program's gradient merge
            self._program = to_static(self.model, loss=self.loss, optimizer=self.optimizer, strategy=strategy,
                                      outputs=True)
        return self._program

    def _loss_for(self, mode: str) -> Callable[..., Any]:
        """The loss (train and eval need one; train an optimizer too)."""
        if self.loss is None:
            raise ValueError(f"ap.Engine.run(mode={mode!r}) needs a loss; the Engine was given none")
        if mode == "train" and self.optimizer is None:
            raise ValueError("ap.Engine.run(mode='train') needs an optimizer; the Engine was given none")
        return self.loss

    def _run_pipeline(self, inputs: list[Any], labels: list[Any], mode: str) -> dict[str, Any]:
        """``run`` under ``Strategy.pipeline``: train through the Pipeline's schedule; eval and
        predict through the stages one after another. The loss and metrics reach every rank."""
        assert self._pipe is not None and self._stages is not None
        if len(inputs) != 1 or len(labels) > 1:
            raise ValueError(f"ap.Engine: a pipeline takes one input and at most one label per batch, got "
                             f"{len(inputs)} inputs and {len(labels)} labels")
        x = inputs[0]
        if mode == "predict":
            self.model.eval()
            with torch.no_grad():
                out = run_stages(self._stages, x)
            return {"outputs": whole(self._everywhere(out))}
        loss_fn = self._loss_for(mode)
        if mode == "train":
            self._check_micro_batches(x.shape[0])
            self.model.train()
            loss = self._pipe.step(x, labels[0] if labels else None)
            self._trained()
        else:
            self.model.eval()
            with torch.no_grad():
                out = run_stages(self._stages, x)
                loss = loss_fn(out, *labels)
            if runtime.get_rank() in self._stages[-1].mesh:  # (the output lives there)
                self._update_metrics(_detached(out), labels)
        last = self._stages[-1].mesh
        names, values = self._metric_values() if runtime.get_rank() in last else (self._metric_names(), None)
        here = [_float(loss.detach()), *values] if values is not None else [0.0] * (1 + len(names))
        got = whole(self._everywhere(dtensor_from_local(torch.tensor(here, dtype=torch.float64), last,
                                                        [Replicate()] * last.ndim, (len(here),)))).tolist()
        return {"loss": got[0], **dict(zip(names, got[1:], strict=True))}

    @staticmethod
    def _everywhere(t: DistTensor) -> DistTensor:
        """``t`` (on the last stage's mesh) replicated on every rank of the world."""
        world = ProcessMesh(list(range(runtime.get_world_size())), dim_names=["world"])
        return reshard(t, world, [Replicate()])

    def _trained(self) -> None:
        """One more run's gradients are in: the optimizer steps every ``merge_steps`` runs."""
        self._micro += 1
        if self._micro == self.merge_steps:
            self._step()

    def _step(self) -> None:
        assert self.optimizer is not None
        k, self._micro = self._micro, 0
        if k > 1:  # gradient merge: the mean of the k runs' gradients
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.div_(k)
        if self.scaler is None:
            self.optimizer.step()
        else:  # unscaled, checked for inf/NaN on every rank alike; skipped everywhere if found
            self.scaler.step(self.optimizer)
            amp = self.strategy.amp  # a fixed scale: set back after each update
            self.scaler.update(None if amp.use_dynamic_loss_scaling else amp.init_loss_scaling)
        self.optimizer.zero_grad()

    def _update_metrics(self, out: Any, labels: list[Any]) -> None:
        """Feed one output (a batch, or a pipeline's micro-batch) to the ``ap.metrics``."""
        for m in self.metrics:
            if hasattr(m, "accumulate"):
                computed = m.compute(out, *labels) if hasattr(m, "compute") else (out, *labels)
                m.update(*(computed if isinstance(computed, (tuple, list)) else (computed,)))

    def _metric_names(self) -> list[str]:
        names: list[str] = []
        for m in self.metrics:
            if hasattr(m, "accumulate"):
                n = m.name()
                names += [n] if isinstance(n, str) else list(n)
        return names

    def _metric_values(self) -> tuple[list[str], list[float]]:
        """The ``ap.metrics``' names and accumulated values."""
        values: list[float] = []
        for m in self.metrics:
            if hasattr(m, "accumulate"):
                v = m.accumulate()
                values += [_float(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
        return self._metric_names(), values

    def _measure(self, out: Any, labels: list[Any]) -> dict[str, float]:
        """Update every metric with one batch's output; the ``ap.metrics``' accumulated values and
        each callable metric's dict for this batch."""
        self._update_metrics(out, labels)
        names, values = self._metric_values()
        logs: dict[str, float] = dict(zip(names, values, strict=True))
        for m in self.metrics:
            if not hasattr(m, "accumulate"):
                got = m(out, labels[0] if len(labels) == 1 else labels)
                if not isinstance(got, Mapping):
                    raise TypeError(f"ap.Engine: metric {m!r} returned {type(got).__name__}, not a dict")
                logs.update({str(k): _float(v) for k, v in got.items()})
        return logs

    def _reset_metrics(self) -> None:
        for m in self.metrics:
            if hasattr(m, "reset"):
                m.reset()

    # ---- loops ----------------------------------------------------------------------------------
    def _loader(self, data: Any, batch_size: int, mode: str, shuffle: bool = False) -> EngineLoader:
        return data if isinstance(data, EngineLoader) else self.dataloader(data, batch_size, shuffle=shuffle, mode=mode)

    def fit(self, train_data: Any, valid_data: Any = None, batch_size: int = 1, epochs: int = 1,
            steps_per_epoch: int | None = None, shuffle: bool = False, verbose: int = 1) -> list[dict[str, float]]:
        """Train ``epochs`` passes over ``train_data`` (a dataset or an ``Engine.dataloader``);
        returns one dict per epoch: the mean loss (and mean of callable metrics) over its steps,
        ``ap.metrics`` accumulated over it, and ``val_``-prefixed ``evaluate`` results."""
        loader = self._loader(train_data, batch_size, "train", shuffle)
        history = []
        for epoch in range(epochs):
            summary = Summary()
            for step, data in enumerate(progress(loader(), len(loader), f"epoch {epoch + 1}/{epochs}", verbose)):
                summary.add(self.run(data, mode="train"))
                if steps_per_epoch is not None and step + 1 >= steps_per_epoch:
                    break
            logs = summary.result(self._accumulated())
            if valid_data is not None:
                logs.update({f"val_{k}": v for k, v in self.evaluate(valid_data, batch_size, verbose=0).items()})
            history.append(logs)
        return history

    def evaluate(self, valid_data: Any, batch_size: int = 1, steps: int | None = None,
                 verbose: int = 1) -> dict[str, float]:
        """Loss and metrics over ``valid_data`` (no update): the mean loss over its batches, ``ap.metrics``
        accumulated over them."""
        loader = self._loader(valid_data, batch_size, "eval")
        summary = Summary()
        for step, data in enumerate(progress(loader(), len(loader), "evaluate", verbose)):
            summary.add(self.run(data, mode="eval"))
            if steps is not None and step + 1 >= steps:
                break
        return summary.result(self._accumulated())

    def predict(self, test_data: Any, batch_size: int = 1, steps: int | None = None,
                verbose: int = 1) -> list[torch.Tensor]:
        """The model's full outputs, one tensor per batch, on every rank."""
        loader = self._loader(test_data, batch_size, "predict")
        outs = []
        for step, data in enumerate(progress(loader(), len(loader), "predict", verbose)):
            outs.append(self.run(data, mode="predict")["outputs"])
            if steps is not None and step + 1 >= steps:
                break
        return outs

    def _accumulated(self) -> set[str]:
        names: set[str] = set()
        for m in self.metrics:
            if hasattr(m, "accumulate"):
                n = m.name()
                names.update([n] if isinstance(n, str) else n)
        return names

    # ---- checkpoints --------------------------------------------------------------------------
    def _state(self, optimizer: bool) -> dict[str, Any]:
        if self.mesh is None:
            raise ValueError("ap.Engine: call prepare() (or dataloader/run/fit) before save/load, so the "
                             "model is laid out")
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if optimizer and self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def save(self, path: str, training: bool = True) -> None:
        """``ap.save_state_dict({"model": ..., "optimizer": ...}, path)`` (the optimizer if ``training``)."""
        save_state_dict(self._state(training), path)

    def load(self, path: str, strict: bool = True, load_optimizer: bool = True) -> None:
        """Fill the model (and optimizer) from ``path`` in their current layout.

        ``strict`` holds for what is loaded: with ``load_optimizer=False`` the checkpoint's optimizer
        state is left unread; a checkpoint saved with ``training=False`` loads the model and warns
        that the optimizer keeps its state."""
        keys = checkpoint_keys(path)
        saved_optimizer = any(k.startswith("optimizer.") for k in keys)
        if load_optimizer and self.optimizer is not None and not saved_optimizer:
            warnings.warn(f"Engine.load: {path!r} holds no optimizer state (saved with training=False): the model is "
                          "loaded, the optimizer keeps its own state", stacklevel=2)
            load_optimizer = False
        if load_optimizer and self.optimizer is not None:
            init_optimizer_state(self.optimizer)
        state = self._state(load_optimizer)
        partial = strict and saved_optimizer and "optimizer" not in state
        if partial:  # the optimizer's keys are not asked for: every model key must still be there
            known = set(keys)
            missing = [k for k in flatten(state, "Engine.load") if k not in known]
            if missing:
                raise ValueError(f"Engine.load: {len(missing)} key(s) of the model are not in {path!r}: {missing[:8]}")
        load_state_dict(state, path, strict=strict and not partial)
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            assert self.optimizer is not None
            self.optimizer.load_state_dict(state["optimizer"])


__all__ = ["Engine", "EngineLoader", "InputSpec", "MODES"]
