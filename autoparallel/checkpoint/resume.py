"""What a resumed run needs besides parameters: RNG states and materialised optimizer state.

``rng_state()`` captures every rank's random number generators (torch CPU, the current CUDA
device if initialised, Python ``random``, NumPy, and any ``torch.Generator`` you name, e.g. a
data loader's) as DistTensors of shape ``(world size, n)`` split over a 1-d mesh of all ranks:
row ``r`` is rank ``r``'s state, written by rank ``r``. Put the dict into the state dict you
save; on resume put a fresh ``rng_state()`` into the target, load, then ``set_rng_state``.
Restoring needs the same world size (a different one fails the load with a shape mismatch).

``init_optimizer_state`` creates an optimizer's lazily built state (Adam moments, SGD momentum,
step counters) so that ``optimizer.state_dict()`` has every entry a checkpoint fills.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from autoparallel import runtime


def _world_mesh() -> Any:
    from autoparallel.mesh import ProcessMesh  # noqa: PLC0415  (mesh imports comm lazily)

    return ProcessMesh(list(range(runtime.get_world_size())), dim_names=["rank"])


def _python_row() -> torch.Tensor:
    version, internal, gauss = random.getstate()
    vals = [float(version), *map(float, internal), float(gauss is not None), gauss or 0.0]
    return torch.tensor(vals, dtype=torch.float64)


def _set_python(row: torch.Tensor) -> None:
    v = row.tolist()
    random.setstate((int(v[0]), tuple(int(x) for x in v[1:-2]), v[-1] if v[-2] else None))


def _numpy_row() -> torch.Tensor:
    state: Any = np.random.get_state(legacy=True)  # ("MT19937", keys, pos, has_gauss, cached)
    _, keys, pos, has_gauss, cached = state
    return torch.tensor([*keys.tolist(), pos, has_gauss, cached], dtype=torch.float64)


def _set_numpy(row: torch.Tensor) -> None:
    v = row.tolist()
    np.random.set_state(("MT19937", np.array(v[:-3], dtype=np.uint32), int(v[-3]), int(v[-2]), v[-1]))


def rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, torch.Tensor]:
    """Every rank's RNG states as ``(world size, n)`` DistTensors (collective: call on all ranks)."""
    from autoparallel.api import dtensor_from_local  # noqa: PLC0415
    from autoparallel.placement import Shard  # noqa: PLC0415

    rows = {"torch": torch.get_rng_state(), "python": _python_row(), "numpy": _numpy_row()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rows["cuda"] = torch.cuda.get_rng_state()
    for name, g in (generators or {}).items():
        rows[f"generator.{name}"] = g.get_state()
    mesh = _world_mesh()
    return {k: dtensor_from_local(v.unsqueeze(0).clone(), mesh, [Shard(0)]) for k, v in rows.items()}


def set_rng_state(state: Mapping[str, torch.Tensor], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Restore this rank's generators from ``state`` (as returned by ``rng_state`` and then loaded)."""
    from autoparallel.engine import layout  # noqa: PLC0415  (the engine loads on first use, not with the package)

    rank, world = runtime.get_rank(), runtime.get_world_size()
    rows = {}
    for key, t in state.items():
        if t.shape[0] != world:
            raise ValueError(f"set_rng_state: {key!r} holds the states of {t.shape[0]} ranks; this world "
                             f"has {world} (RNG states can only be restored on the same world size)")
        rows[key] = (layout.local_of(t)[0] if layout.is_dist(t) else t[rank]).detach().cpu()
    for key, row in rows.items():
        if key == "torch":
            torch.set_rng_state(row.to(torch.uint8).clone())
        elif key == "cuda":
            torch.cuda.set_rng_state(row.to(torch.uint8).clone())
        elif key == "python":
            _set_python(row)
        elif key == "numpy":
            _set_numpy(row)
        elif key.startswith("generator."):
            gens = generators or {}
            name = key[len("generator."):]
            if name not in gens:
                raise ValueError(f"set_rng_state: state has generator {name!r}; pass it in generators= "
                                 f"(got {sorted(gens)})")
            gens[name].set_state(row.to(torch.uint8).clone())
        else:
            raise ValueError(f"set_rng_state: unknown entry {key!r}")


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s per-parameter state without changing any parameter.

    Runs one ``step()`` with zero gradients and every learning rate set to 0, then restores the
    learning rates and clears the gradients. Does nothing if the state already exists. A wrapper
    holding the real optimizer as ``.inner`` (``ap.shard_optimizer``) has its inner optimizer
    initialised directly, on the parameters (or ZeRO shards) that optimizer steps: no collective.
    Parameters that do not require grad (frozen) get no state, as in training.
    """
    _init_state(optimizer, None)


def _trained(wrapper: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> set[int]:
    """ids of the tensors ``inner`` steps whose model parameter requires grad (all of them for a
    wrapper that does not say which they are). ZeRO-1/2 shards never require grad themselves:
    their parameter decides, as in a step (``ShardedOptimizer.stepped_trained``)."""
    stepped = getattr(wrapper, "stepped_trained", None)
    if stepped is None:
        return {id(p) for g in inner.param_groups for p in g["params"]}
    return {id(t) for t in stepped()}


def _init_state(optimizer: torch.optim.Optimizer, trained: set[int] | None) -> None:
    """``init_optimizer_state``; ``trained``: ids of the parameters to step (None: requires_grad)."""
    if len(optimizer.state) > 0:
        return
    inner = getattr(optimizer, "inner", None)
    if isinstance(inner, torch.optim.Optimizer):
        _init_state(inner, _trained(optimizer, inner))
        return
    params = [p for g in optimizer.param_groups for p in g["params"]
              if (p.requires_grad if trained is None else id(p) in trained)]
    if any(p.grad is not None for p in params):
        raise ValueError("init_optimizer_state: parameters already have gradients; call it right "
                         "after building the optimizer, before any backward")
    saved = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            if lr is not None:
                g["lr"] = lr
        for p in params:
            p.grad = None
