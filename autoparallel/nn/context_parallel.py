"""``ContextParallel``: an attention module's sequence sharded along a mesh axis ("cp").

The style works through layouts, like every style: its hooks only move tensors (``ap.reshard``
/ ``ap.shard_tensor``), and the engine does the rest where the layout says so.

- ``comm="ring"``: the module's hidden states enter ``Shard(seq_dim)`` on the cp axis (a local
  slice when they arrive replicated on it, nothing when they arrive sharded). Inside, the
  projections run on the token shards (``F.linear`` flattens a sequence-sharded activation to
  ``[batch * seq, width]``, a ``StridedShard`` of the tokens, and stays on the shards) and scaled-dot-product attention, meeting query, key and
  value sharded on the sequence, runs as ring attention (``engine.ring_attention``: key/value
  pieces travel around the axis, causal masks load-balanced). The output stays sharded, so
  what follows (MLP, norms, the next block, the head) runs on the token shards and the next
  attention module's hook finds its input laid out already.
- ``comm="all_to_all"`` (DeepSpeed-Ulysses): the same, and besides the query/key/value
  projections' outputs move from sequence shards to head shards (one all-to-all each) and the
  output projection's input moves back (one all-to-all): attention runs on whole sequences
  of ``heads / cp`` heads. Query and key/value heads must divide by the cp degree.

Positions need nothing: a DistTensor holds the global sequence, so position tables, rotary
embeddings, ``position_ids`` and causal masks are the global ones, sliced where they meet the
shards. The sequence length must divide by the cp degree (``ValueError`` at the forward
pre-hook, from the global shape, on every rank before any collective of that step). A mask
tensor (transformers passes its causal mask as one) is sharded by its query rows and read
column piece by column piece: every block is computed then, since a mask's zeros are data.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from autoparallel import runtime
from autoparallel.mesh import ProcessMesh
from autoparallel.nn.layout import to_layout
from autoparallel.nn.styles import ParallelStyle, PlanContext, positional_names
from autoparallel.placement import Placement, Shard
from autoparallel.regions import moves

COMMS = ("ring", "all_to_all")
# (query/key/value projections, output projection) of attention modules we know by name
KNOWN_PROJECTIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "o_proj"),   # Llama, Mistral, Qwen2 (transformers)
    (("qkv",), "proj"),                            # examples.gpt_model, timm-style ViT
    (("query", "key", "value"), "dense"),          # BERT-style self-attention blocks
)


class ContextParallel(ParallelStyle):
    """Context parallelism for an attention module (see the module docstring).

    ``seq_dim``: the sequence dim of the module's hidden-states input. ``comm``: ``"ring"`` or
    ``"all_to_all"``. ``axis``: the mesh axis (name or number, default ``"cp"``).
    ``projections``/``output``: for ``"all_to_all"``, the names of the query/key/value
    projection submodules and of the output projection (default: found by name, Llama's
    ``q_proj``/``k_proj``/``v_proj``/``o_proj`` or a fused ``qkv``/``proj``). Parameters are
    not laid out here (they stay as other styles or ``parallelize`` make them).
    """

    shards_parameters = False
    uses_tp_axis = False

    def __init__(self, seq_dim: int = 1, comm: str = "ring", axis: int | str = "cp",
                 projections: tuple[str, ...] | None = None, output: str | None = None) -> None:
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
            raise TypeError(f"ContextParallel: seq_dim must be an int tensor dim, got {seq_dim!r}")
        if comm not in COMMS:
            raise ValueError(f"ContextParallel: comm must be one of {COMMS}, got {comm!r}")
        if projections is not None and (isinstance(projections, str) or not all(isinstance(p, str) for p in projections)):
            raise TypeError(f"ContextParallel: projections must be a tuple of submodule names, got {projections!r}")
        self.seq_dim, self.comm, self.axis = seq_dim, comm, axis
        self.projections = None if projections is None else tuple(projections)
        self.output = output

    def _axis(self, mesh: ProcessMesh, name: str) -> int:
        try:
            return mesh.axis_index(self.axis)
        except ValueError as e:
            raise ValueError(f"ContextParallel on {name!r}: context-parallel axis {self.axis!r}: {e}") from None

    def _projections(self, name: str, module: nn.Module) -> tuple[tuple[str, ...], str]:
        children = dict(module.named_children())
        if self.projections is not None or self.output is not None:
            pick = (self.projections or (), self.output or "")
            missing = [p for p in (*pick[0], pick[1]) if p not in children]
            if missing or not pick[0]:
                raise ValueError(f"ContextParallel on {name!r}: no submodule {missing or ['(projections)']}; "
                                 f"it has {sorted(children)}")
            return pick
        for qkv, out in KNOWN_PROJECTIONS:
            if all(p in children for p in (*qkv, out)):
                return qkv, out
        raise ValueError(
            f"ContextParallel(comm='all_to_all') on {name!r}: cannot tell its query/key/value and output "
            f"projections among {sorted(children)}; pass projections=(...) and output=...")

    def check(self, name: str, module: nn.Module, mesh: ProcessMesh, axis: int) -> None:
        self._axis(mesh, name)
        if self.comm == "all_to_all":
            self._projections(name, module)

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        return {}

    def io_layouts(self, module: nn.Module, seq_dim: int | None) -> tuple[Any, Any]:
        return Shard(self.seq_dim), Shard(self.seq_dim)

    def apply(self, name: str, module: nn.Module, ctx: PlanContext) -> None:
        where = f"ContextParallel({name!r})"
        cp = self._axis(ctx.mesh, name)
        degree = ctx.mesh.shape[cp]
        seq = Shard(self.seq_dim)
        names = positional_names(module)
        first = names[0] if names else None

        def check(x: Any) -> None:
            if not isinstance(x, torch.Tensor):
                return
            if not -x.dim() <= self.seq_dim < x.dim():
                raise ValueError(f"{where}: sequence dim {self.seq_dim} does not exist on hidden states of shape "
                                 f"{tuple(x.shape)}")
            n = x.shape[self.seq_dim]
            if n % degree:
                raise ValueError(
                    f"{where}: sequence length {n} (dim {self.seq_dim} of shape {tuple(x.shape)}) does not divide "
                    f"by the context-parallel degree {degree} (mesh axis {ctx.mesh.dim_names[cp]!r}); pad the "
                    "sequences to a multiple of it (twice it balances causal attention best)")

        def enter(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if args:
                check(args[0])
                args = (to_layout(args[0], ctx.mesh, cp, seq, where), *args[1:])
            elif first is not None and first in kwargs:  # ``self_attn(hidden_states=h, ...)``
                check(kwargs[first])
                kwargs = {**kwargs, first: to_layout(kwargs[first], ctx.mesh, cp, seq, where)}
            return args, kwargs

        module.register_forward_pre_hook(moves.style_hook(enter, ("cp enter", ctx.mesh, cp, self.seq_dim, first)), with_kwargs=True)
        if self.comm == "ring":
            return
        qkv, out = self._projections(name, module)
        heads = Shard(-1)

        head_dim = getattr(module, "head_dim", None)
        fused = 3 if len(qkv) == 1 else 1  # one projection making query, key and value (head-major)

        def to_heads(m: nn.Module, args: tuple[Any, ...], y: Any) -> Any:
            if isinstance(y, torch.Tensor):
                n = y.shape[-1] // (head_dim * fused) if isinstance(head_dim, int) and head_dim > 0 else y.shape[-1]
                split = degree  # the heads are split by cp and by any axis splitting them already (tp)
                names = [ctx.mesh.dim_names[cp]]
                for b, p in enumerate(getattr(y, "placements", ())):
                    if b != cp and isinstance(p, Shard) and p.dim % y.dim() == y.dim() - 1:
                        split *= ctx.mesh.shape[b]
                        names.append(ctx.mesh.dim_names[b])
                if n % split:
                    raise ValueError(
                        f"{where}: all_to_all shards attention by heads, but a projection gives {n} "
                        f"{'heads' if n != y.shape[-1] else 'features'}, which do not divide by {split} "
                        f"(mesh axes {names}); use comm='ring'")
            return to_layout(y, ctx.mesh, cp, heads, where)

        def to_sequence(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (to_layout(args[0], ctx.mesh, cp, seq, where), *args[1:]) if args else args

        children = dict(module.named_children())
        for p in qkv:
            children[p].register_forward_hook(moves.style_hook(to_heads, ("cp heads", ctx.mesh, cp, head_dim, fused)))
        children[out].register_forward_pre_hook(moves.style_hook(to_sequence, ("cp sequence", ctx.mesh, cp, self.seq_dim)))


def warn_idle_axis(mesh: ProcessMesh, styles: Any) -> None:
    """Warn once (rank 0) when ``mesh`` has a ``"cp"`` axis of more than one rank but no
    ``ContextParallel`` style lays anything out on it: every rank of that axis would compute the
    whole sequence (no context parallelism). Metadata only."""
    if "cp" not in mesh.dim_names or mesh.get_dim_size("cp") == 1:
        return
    if any(isinstance(st, ContextParallel) for st in styles) or runtime.get_rank() != 0:
        return
    warnings.warn(
        f"parallelize: the mesh has a context-parallel axis 'cp' ({mesh.get_dim_size('cp')} ranks) but the plan "
        "has no ContextParallel style: every rank of that axis computes the whole sequence. Add "
        "ap.ContextParallel() for the attention modules (docs/context_parallel.md)", stacklevel=3)


__all__ = ["COMMS", "ContextParallel", "warn_idle_axis"]
