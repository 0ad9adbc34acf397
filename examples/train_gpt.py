"""Train a small GPT on the shipped corpus with DP x TP (+ Megatron SP, ZeRO), checked against one process.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py            # dp=2 x tp=2, SP on
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --dp 4 --zero 3
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --dp 1 --tp 4 --no-sp
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --dp 2 --cp 2 --tp 1 --no-sp
    python examples/train_gpt.py --dp 1 --tp 1                               # one process
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --ckpt ckpt --save-every 10
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --ckpt ckpt --resume

The model (examples/gpt_model.py) is written for one device. The mesh is ``dp x mp``; the
parallel plan makes the qkv and MLP-up Linears column-parallel, the two output projections
row-parallel, the token embedding vocabulary-parallel (and so the tied LM head: logits stay
split over the vocabulary and the loss is computed without gathering them); with ``--sp``
the LayerNorms and residual stream are split on the sequence dim between the blocks
(Megatron sequence parallel: all-gather before qkv/fc, reduce-scatter after the projections).
``--zero`` shards the AdamW states (1), also the gradients (2), also the parameters (3) over
``dp``. ``--cp N`` adds a context-parallel axis ``cp`` (mesh ``dp x cp x mp``): every attention
module is ``ap.ContextParallel(comm=--cp-comm)``, so the sequence is split through attention
(ring or all-to-all) and everything after it (not with ``--sp``). Each data-parallel rank loads
only its part of every batch.

With ``--check`` (default) rank 0 then trains the same model, same seed, same batches in one
process and compares the loss at every step (relative difference <= 1e-5) and every final
parameter tensor (||p - p_ref|| <= 1e-5 ||p_ref||); any mismatch makes every rank exit non-zero.
The last line printed says PASS or FAIL overall and for each checked figure:
``PASS: loss max rel diff 1.7e-07 <= 1e-05 PASS; parameters max rel diff 8.4e-07 <= 1e-05 PASS``.

ELEMENTWISE: the distributed run sums in another order (per-rank partial sums over the batch,
over the sequence under SP, over hidden features in row-parallel layers), so gradients agree to
about 1e-7 relative, not bitwise. SGD moves each element by lr x gradient, and its parameters
agree elementwise. Adam's step lr x m / (sqrt(v) + eps) is scale-free: an element whose
gradient is mostly cancellation, near eps = 1e-8, takes a step set by its roundoff. Measured
in ONE process (no library code), summing the gradients of the two half batches instead of
the whole batch: blocks.1.ln1.weight[28] has gradient 3.18e-9 vs 3.22e-9 at step 1, and the
two AdamW runs differ there by 5.8e-6 after that step. So with AdamW a few of the ~100k
elements differ by 1e-6..2e-5 while every tensor agrees to ~1e-6 normwise and the loss to
~1e-7; the check counts those elements but decides on the normwise criterion. At lr 3e-3
the same one-process experiment drifts to 9e-6 in the loss and 4e-5 normwise by step 40
(chaotic growth), which is why AdamW's default lr here is 1e-3 (1.2e-7 and 4.8e-7 by step 40,
1.4e-7 and 1.0e-6 by step 100).

Training state is explicit (``TrainState``: step, losses, the data sampler's position and the
RNG state), so a checkpoint can save and restore it. ``--ckpt DIR --save-every N`` saves model,
optimizer, that state and every rank's RNG with ``ap.save_state_dict`` every N steps and after
the last one; ``--resume`` loads the last checkpoint in DIR and continues: on the same layout the
losses are bitwise those of an uninterrupted run; on another layout of the same world size
(the RNG is per rank) they agree to roundoff. ``--die-at-step K --die-rank R`` simulates a fault:
rank R exits abruptly after step K (status 0, so torchrun does not tear the job down itself: the
others must notice, as ranks on other nodes would). The survivors then fail in their next
collective with a "lost contact" error within ``AUTOPARALLEL_TIMEOUT`` seconds and exit with
status 1 (see docs/checkpoint.md, "Resuming training exactly").
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_data import CharTokenizer, ResumableSampler, TokenWindows, load_corpus  # noqa: E402
from gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402

import autoparallel as ap  # noqa: E402

RTOL = 1e-5
# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 2e-3 per op); the distributed run rounds
# other partial sums (per rank, per sequence shard) than one process, so losses and parameters
# agree to a few bf16 ulps, not to fp32 roundoff. Parameters are then judged model-wide
# (||all p - all p_ref|| / ||all p_ref||): AdamW's first steps move each element by about
# lr x sign(g), so a zero-initialised bias whose gradient is within bf16 noise of zero differs by
# 10-20% of its (tiny) norm from one process, also with autocast alone (docs/mixed_precision.md).
BF16_RTOL = 2e-2

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel degree (mesh axis 'dp')")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (mesh axis 'mp')")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=True, help="Megatron sequence parallel")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (mesh axis 'cp'; with --no-sp)")
    p.add_argument("--cp-comm", choices=("ring", "all_to_all"), default="ring", help="context parallelism's attention")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage over 'dp'")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=True, help="tie the LM head to the embedding")
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw",
                   help="AdamW (betas 0.9/0.95, weight decay 0.1) or SGD (momentum 0.9, weight decay 1e-4)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 for AdamW, 0.1 for SGD)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recompute of every block (ap.parallelize(recompute={'blocks.*': ...}))")
    p.add_argument("--bf16", action="store_true",
                   help="bfloat16 autocast forward (fp32 parameters and optimizer states); checked at rtol BF16_RTOL")
    p.add_argument("--static", action="store_true",
                   help="static mode: capture the training step once (ap.to_static) and replay it")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with a single-process run on rank 0")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar on stderr")
    p.add_argument("--ckpt", default=None, metavar="DIR", help="checkpoint folder (saved every --save-every steps)")
    p.add_argument("--save-every", type=int, default=10, metavar="N",
                   help="with --ckpt: save every N steps and after the last step (0: only after the last)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --ckpt DIR")
    p.add_argument("--losses-out", default=None, metavar="FILE", help="rank 0 writes the per-step losses as JSON")
    p.add_argument("--die-at-step", type=int, default=None, metavar="K",
                   help="simulated fault: rank --die-rank exits abruptly after step K")
    p.add_argument("--die-rank", type=int, default=0, metavar="R", help="the rank --die-at-step kills")
    return p.parse_args(argv)


def check_config(args: argparse.Namespace, world: int, vocab: int) -> None:
    """Raise ValueError (same on every rank, before any collective) for a bad configuration."""
    ranks = args.dp * args.cp * args.tp
    if args.dp < 1 or args.tp < 1 or args.cp < 1 or ranks != world:
        cp = f" x --cp {args.cp}" if args.cp != 1 else ""
        raise ValueError(f"--dp {args.dp}{cp} x --tp {args.tp} = {ranks} ranks, but the world has {world} "
                         f"(run with torchrun --nproc-per-node {ranks}, or change --dp/{'--cp/' if cp else ''}--tp)")
    if args.cp > 1 and args.sp and args.tp > 1:
        raise ValueError("--cp splits the sequence everywhere; use it with --no-sp (one sequence split at a time)")
    if args.cp > 1 and args.seq % args.cp:
        raise ValueError(f"--cp {args.cp} must divide --seq {args.seq}")
    if args.cp > 1 and args.cp_comm == "all_to_all" and args.heads % (args.cp * args.tp):
        raise ValueError(f"--cp-comm all_to_all splits the heads: --cp {args.cp} x --tp {args.tp} must divide --heads {args.heads}")
    if args.batch % args.dp:
        raise ValueError(f"--batch {args.batch} is not divisible by --dp {args.dp}")
    if args.heads % args.tp or (4 * args.width) % args.tp or vocab % args.tp:
        raise ValueError(f"--tp {args.tp} must divide --heads {args.heads}, 4 x --width {4 * args.width} "
                         f"and the vocabulary size {vocab}")
    if args.sp and args.tp > 1 and args.seq % args.tp:
        raise ValueError(f"--sp needs --seq {args.seq} divisible by --tp {args.tp}")
    if args.zero and args.dp == 1:
        raise ValueError(f"--zero {args.zero} shards over 'dp' and needs --dp > 1")
    if args.resume and not args.ckpt:
        raise ValueError("--resume needs --ckpt DIR (the folder holding the checkpoint)")
    if args.save_every < 0:
        raise ValueError(f"--save-every {args.save_every} must be >= 0")
    if args.die_at_step is not None and not (1 <= args.die_at_step < args.steps and 0 <= args.die_rank < world):
        raise ValueError(f"--die-at-step {args.die_at_step} --die-rank {args.die_rank}: need 1 <= K < --steps "
                         f"{args.steps} and 0 <= R < world size {world}")


@dataclass
class TrainState:
    """Everything a resumed run needs besides model and optimizer: step, losses, data position, RNG."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    sampler: dict[str, int] = field(default_factory=dict)
    rng: torch.Tensor | None = None


class ProgressBar:
    """Progress on stderr: step, loss, tokens/s — through ``tqdm`` where it is installed (it comes
    with the test extra), else a plain bar redrawn in place on a terminal."""

    def __init__(self, total: int, enabled: bool, width: int = 24) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.tty = sys.stderr.isatty()
        self.every = max(1, total // 10)
        self.tqdm: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.tqdm = tqdm(total=total, file=sys.stderr, unit="step", mininterval=0.5 if self.tty else 30.0)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.tqdm is not None:
            self.tqdm.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=False)
            self.tqdm.update(step - self.tqdm.n)
            return
        if not self.enabled or (not self.tty and step % self.every and step != self.total):
            return
        filled = self.width * step // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] step {step:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        sys.stderr.write(("\r" + line) if self.tty else (line + "\n"))
        sys.stderr.flush()

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
            return
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def gpt_plan(sp: bool, cp: str | None = None) -> dict[str, Any]:
    """The tensor-parallel plan of ``GPT`` (module-name patterns -> styles), with or without SP;
    ``cp``: context parallelism ("ring" or "all_to_all") on every attention module."""
    plan: dict[str, Any] = {
        "tok": ap.VocabParallelEmbedding(),      # rows split; Partial out -> reduce-scatter (SP) / all-reduce
        "blocks.*.attn.qkv": ap.ColWiseParallel(),  # head-major qkv: whole heads per rank
        "blocks.*.attn.proj": ap.RowWiseParallel(),
        "blocks.*.mlp.fc": ap.ColWiseParallel(),
        "blocks.*.mlp.proj": ap.RowWiseParallel(),
        "head": ap.ColWiseParallel(),            # tied to tok (same Shard(0)); logits split: loss parallel
    }
    if sp:
        plan.update({"blocks.*.ln1": ap.SequenceParallel(), "blocks.*.ln2": ap.SequenceParallel(),
                     "ln_f": ap.SequenceParallel()})
    if cp is not None:
        plan["blocks.*.attn"] = ap.ContextParallel(comm=cp)
    return plan


def parallelize_gpt(model: GPT, mesh: ap.ProcessMesh, sp: bool, recompute: str = "none", cp: str | None = None) -> GPT:
    """Lay ``model`` out on ``mesh``: TP (+ SP) on axis "mp", every parameter Replicate on "dp"
    (and "cp": context parallelism by ``cp``); ``recompute`` ("none", "selective", "full") for every block."""
    ap.parallelize(model, mesh, gpt_plan(sp, cp), recompute=None if recompute == "none" else {"blocks.*": recompute})
    return model


def wrap_optimizer(opt: torch.optim.Optimizer, mesh: ap.ProcessMesh, zero: int) -> torch.optim.Optimizer:
    """Bucketed data-parallel gradient reduction, plus ZeRO stage ``zero`` over axis "dp"."""
    stages = {1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}
    return ap.shard_optimizer(opt, stages[zero](mesh, "dp") if zero else None)


def make_loader(data: TokenWindows, batch: int, seed: int) -> tuple[DataLoader, ResumableSampler]:
    """A DataLoader over ``data`` whose sampler's position is the run's data position."""
    sampler = ResumableSampler(len(data), seed=seed)
    return DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True), sampler


def scalar(x: torch.Tensor) -> float:
    """A Python float from a loss (a DistTensor is gathered first)."""
    x = x.detach()
    return float(x.full_tensor() if isinstance(x, ap.DistTensor) else x)


def world_device() -> torch.device:
    """Where this rank computes: its CUDA device under NCCL (torchrun on GPUs), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def eager_step(model: nn.Module, opt: torch.optim.Optimizer, bf16: bool = False) -> Callable[[Any, Any], torch.Tensor]:
    """One training step, eagerly: forward (under bf16 autocast with ``bf16``), loss, backward, optimizer step."""
    device = world_device()

    def step(x: Any, y: Any) -> torch.Tensor:
        if not isinstance(x, ap.DistTensor):  # the single-process reference: plain host batches
            x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss
    return step


def train(step: Callable[[Any, Any], torch.Tensor], batches: Iterator[Batch], sampler: ResumableSampler,
          state: TrainState, steps: int, tokens_per_step: int, bar: ProgressBar,
          after_step: Callable[[TrainState], None] | None = None) -> TrainState:
    """Run steps ``state.step .. steps-1``, updating ``state`` after each one (then ``after_step(state)``)."""
    times = [time.perf_counter()]
    while state.step < steps:
        x, y = next(batches)
        loss = step(x, y)
        state.losses.append(scalar(loss))
        state.step += 1
        state.sampler, state.rng = sampler.state_dict(), torch.get_rng_state()
        times.append(time.perf_counter())
        recent = times[-11:]                     # tokens/s over the last (up to) 10 steps
        rate = tokens_per_step * (len(recent) - 1) / (recent[-1] - recent[0])
        bar.update(state.step, state.losses[-1], rate)
        if after_step is not None:
            after_step(state)
    bar.close()
    return state


def checkpoint_dict(model: nn.Module, opt: torch.optim.Optimizer, state: TrainState) -> dict[str, Any]:
    """What a checkpoint holds: model, optimizer, step, losses, data position, every rank's RNG (collective)."""
    return {"model": model.state_dict(), "optim": opt.state_dict(),
            "train": {"step": state.step, "losses": list(state.losses), "sampler": dict(state.sampler)},
            "rng": ap.checkpoint.rng_state()}


def load_checkpoint(folder: str, model: nn.Module, opt: torch.optim.Optimizer,
                    sampler: ResumableSampler) -> TrainState:
    """Fill model, optimizer, sampler and this rank's RNG from ``folder``; the state to continue from.

    Model and optimizer load into whatever layout they have; the RNG needs the saving run's world size.
    """
    ap.checkpoint.init_optimizer_state(opt)  # the moments exist (in their layout) to be filled
    sd = checkpoint_dict(model, opt, TrainState())
    ap.load_state_dict(sd, folder)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    ap.checkpoint.set_rng_state(sd["rng"])
    sampler.load_state_dict(sd["train"]["sampler"])
    return TrainState(step=sd["train"]["step"], losses=list(sd["train"]["losses"]),
                      sampler=sampler.state_dict(), rng=torch.get_rng_state())


class Checkpointer:
    """The per-step hook: save every ``--save-every`` steps and after the last, then the simulated fault."""

    def __init__(self, args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
        self.args, self.model, self.opt, self.rank = args, model, opt, rank
        self.saved_step: int | None = None
        self.last = time.perf_counter()  # when the last step (and its save) ended

    def __call__(self, state: TrainState) -> None:
        a = self.args
        if a.ckpt and (state.step == a.steps or (a.save_every and state.step % a.save_every == 0)):
            ap.save_state_dict(checkpoint_dict(self.model, self.opt, state), a.ckpt)
            self.saved_step = state.step
        if a.die_at_step == state.step and a.die_rank == self.rank:
            print(f"rank {self.rank}: simulated fault (--die-at-step {state.step}): exiting abruptly", flush=True)
            sys.stderr.flush()
            os._exit(0)  # no cleanup, no error report: the other ranks must notice on their own
        self.last = time.perf_counter()


def comm_error(e: BaseException) -> bool:
    """True for a failed collective: torch.distributed's errors, gloo's timeouts and closed connections."""
    return (isinstance(e, (dist.DistError, ap.checkpoint.CheckpointError))
            or "gloo" in str(e).lower() or "connection" in str(e).lower())


def lost_contact(rank: int, state: TrainState, hook: Checkpointer, args: argparse.Namespace, e: Exception) -> str:
    """The survivors' message when a collective of the training step fails (a rank died or hung)."""
    from autoparallel import runtime

    detail = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    where = (f"the last checkpoint in {args.ckpt} is from step {hook.saved_step}" if hook.saved_step is not None
             else f"this run saved no checkpoint{' to ' + args.ckpt if args.ckpt else ''}")
    return (f"rank {rank}: step {state.step + 1} failed after {time.perf_counter() - hook.last:.1f}s: lost contact "
            f"with the other ranks (a rank died or hung; collective timeout {runtime.collective_timeout_s()}): "
            f"{type(e).__name__}: {detail}\n{where}; restart the job with --resume to continue from it")


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """The unmodified torch.optim optimizer ``--optim`` names (fused: one op per step for all parameters)."""
    if args.optim == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr or 0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=args.lr or 1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def reference_run(reference: nn.Module, data: TokenWindows, args: argparse.Namespace) -> list[float]:
    """The same training in this process only, on plain tensors (on this rank's device)."""
    reference.to(world_device())
    loader, sampler = make_loader(data, args.batch, args.seed)
    torch.manual_seed(args.seed + 1)
    if args.recompute != "none":
        for block in reference.blocks:  # the same recompute on plain tensors
            ap.recompute(block, args.recompute)
    state = train(eager_step(reference, make_optimizer(reference, args), args.bf16), iter(loader), sampler, TrainState(), args.steps,
                  args.batch * args.seq, ProgressBar(args.steps, False))
    return state.losses


def loss_rel(losses: list[float], ref: list[float]) -> list[float]:
    """The relative difference of the loss at each step from the single-process loss."""
    return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref)]


def loss_table(losses: list[float], ref: list[float], rtol: float = RTOL) -> tuple[bool, list[str]]:
    """(ok, rows): the loss at every step within ``rtol`` of the single-process loss."""
    rel = loss_rel(losses, ref)
    rows = ["  step | parallel loss | single-process loss | rel. diff",
            "  -----+---------------+---------------------+----------"]
    shown = sorted({0, len(rel) - 1, *range(0, len(rel), max(1, len(rel) // 8))})
    rows += [f"  {i + 1:>4} | {losses[i]:>13.6f} | {ref[i]:>19.6f} | {rel[i]:.1e}" for i in shown]
    ok = len(losses) == len(ref) and max(rel, default=0.0) <= rtol
    rows.append(f"  loss: max rel. diff {max(rel, default=0.0):.2e} over {len(rel)} steps (rtol {rtol:g}): "
                f"{'PASS' if ok else 'FAIL'}")
    return ok, rows


@dataclass
class ParamDiff:
    """How far the parameters are from the single-process ones: the worst tensor normwise
    (``worst``, ``worst_name``), all of them as one vector (``whole``), and the elements outside
    the elementwise tolerance (``outside`` of ``total``; the largest, ``el_abs`` in ``el_name``)."""

    worst: float
    worst_name: str
    whole: float
    outside: int
    total: int
    el_name: str
    el_abs: float


def param_diff(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> ParamDiff:
    """The parameters' differences from ``ref`` (see ``ParamDiff``)."""
    worst, worst_name, outside, total, el_name, el_abs = 0.0, "", 0, 0, "", 0.0
    err_sq = ref_sq = 0.0
    for name, q in ref.items():
        err = params[name] - q
        err_sq, ref_sq = err_sq + float(err.double().pow(2).sum()), ref_sq + float(q.double().pow(2).sum())
        r = float(err.norm() / q.norm().clamp_min(1e-30))
        if r >= worst:
            worst, worst_name = r, name
        bad = err.abs() > 1e-6 + RTOL * q.abs()
        outside, total = outside + int(bad.sum()), total + q.numel()
        if bad.any() and float(err.abs().max()) > el_abs:
            el_name, el_abs = name, float(err.abs().max())
    return ParamDiff(worst, worst_name, (err_sq / max(ref_sq, 1e-60)) ** 0.5, outside, total, el_name, el_abs)


def param_report(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float = RTOL,
                 model_wide: bool = False) -> tuple[bool, list[str]]:
    """(ok, rows): every parameter tensor within ``rtol`` normwise (``model_wide``: all of them as
    one vector, the bf16 verdict); elementwise outliers counted."""
    d = param_diff(params, ref)
    ok = (d.whole if model_wide else d.worst) <= rtol
    verdict = f"(rtol {rtol:g}): {'PASS' if ok else 'FAIL'}"
    rows = [f"  parameters: {len(ref)} tensors, max ||p - p_ref|| / ||p_ref|| = {d.worst:.1e} ({d.worst_name})"
            + ("" if model_wide else f" {verdict}"),
            *([f"  model-wide ||p - p_ref|| / ||p_ref|| = {d.whole:.1e} {verdict}"] if model_wide else []),
            f"  elementwise |p - p_ref| <= 1e-6 + {RTOL:g}|p_ref|: {d.outside} of {d.total:,} elements outside"
            + (f" (largest {d.el_abs:.1e} in {d.el_name}; see ELEMENTWISE in --help)" if d.outside else "")]
    return ok, rows


def verdict_line(losses: list[float], ref: list[float], params: dict[str, torch.Tensor],
                 ref_params: dict[str, torch.Tensor], rtol: float = RTOL, model_wide: bool = False) -> str:
    """The last line: PASS or FAIL overall, then each checked figure against its bound with its
    own verdict (the elementwise count above is reported, not checked: ELEMENTWISE in --help)."""
    ok_loss, _ = loss_table(losses, ref, rtol)
    ok_params, _ = param_report(params, ref_params, rtol, model_wide)
    d = param_diff(params, ref_params)
    rel = max(loss_rel(losses, ref), default=0.0)
    steps = "" if len(losses) == len(ref) else f" ({len(losses)} steps vs {len(ref)})"
    p_name, p_value = ("parameters model-wide rel diff", d.whole) if model_wide else ("parameters max rel diff", d.worst)

    def figure(name: str, value: float, ok: bool) -> str:
        return f"{name} {value:.1e} {'<=' if value <= rtol else '>'} {rtol:g} {'PASS' if ok else 'FAIL'}"

    return (f"{'PASS' if ok_loss and ok_params else 'FAIL'}: {figure('loss max rel diff', rel, ok_loss)}{steps}; "
            f"{figure(p_name, p_value, ok_params)}")


def compare(losses: list[float], ref: list[float], params: dict[str, torch.Tensor],
            ref_params: dict[str, torch.Tensor], rtol: float = RTOL, model_wide: bool = False) -> tuple[bool, str]:
    """(ok, table): losses per step and parameters against the single-process run; its last
    line is the verdict on every figure (``verdict_line``)."""
    ok_loss, rows = loss_table(losses, ref, rtol)
    ok_params, more = param_report(params, ref_params, rtol, model_wide)
    last = verdict_line(losses, ref, params, ref_params, rtol, model_wide)
    return ok_loss and ok_params, "\n".join(rows + more + [last])


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor (collective for DistTensors: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if isinstance(p, ap.DistTensor) else p).detach().cpu().clone()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = ap.get_rank(), ap.get_world_size()
    text = load_corpus()
    tok = CharTokenizer(text, multiple_of=8)
    check_config(args, world, tok.vocab_size)
    data = TokenWindows(tok.encode(text), args.seq)
    cfg = GPTConfig(vocab=tok.vocab_size, seq=args.seq, layers=args.layers, width=args.width,
                    heads=args.heads, tied=args.tied)

    torch.manual_seed(args.seed)
    model = GPT(cfg)
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    if args.cp > 1:
        mesh = ap.ProcessMesh(torch.arange(world).reshape(args.dp, args.cp, args.tp).tolist(), dim_names=["dp", "cp", "mp"])
    else:
        mesh = ap.ProcessMesh(torch.arange(world).reshape(args.dp, args.tp).tolist(), dim_names=["dp", "mp"])
    model = parallelize_gpt(model, mesh, sp=args.sp, recompute=args.recompute,
                            cp=args.cp_comm if args.cp > 1 else None)
    opt = wrap_optimizer(make_optimizer(model, args), mesh, args.zero)
    loader, sampler = make_loader(data, args.batch, args.seed)  # each rank loads its dp slice (below)

    if rank == 0:
        n = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {args.layers} layers x width {args.width}, {args.heads} heads, vocab {tok.vocab_size}, "
              f"{n:,} parameters; corpus {len(text):,} chars, {len(data)} windows of {args.seq}")
        cp = f" x cp={args.cp} ({args.cp_comm})" if args.cp > 1 else ""
        print(f"mesh dp={args.dp}{cp} x mp={args.tp}, sequence parallel {'on' if args.sp and args.tp > 1 else 'off'}, "
              f"ZeRO stage {args.zero}, {args.optim}, {'static' if args.static else 'eager'}, recompute {args.recompute}"
              f"{', bf16 autocast' if args.bf16 else ''}; {args.steps} steps of {args.batch} x {args.seq} tokens")
    torch.manual_seed(args.seed + 1)
    state = TrainState()
    if args.resume:
        assert args.ckpt is not None
        state = load_checkpoint(args.ckpt, model, opt, sampler)
        if rank == 0:
            print(f"resumed from the checkpoint in {args.ckpt} at step {state.step}")
    batches = iter(ap.shard_dataloader(loader, mesh, shard_dims="dp"))  # after the sampler's position is set
    hook = Checkpointer(args, model, opt, rank)
    hook.saved_step = state.step if args.resume else None
    first = state.step
    t0 = time.perf_counter()
    try:
        # static: the step is captured once (ap.to_static) and replayed; eager: run op by op
        step = ap.to_static(model, loss=lm_loss, optimizer=opt) if args.static else eager_step(model, opt, args.bf16)
        state = train(step, batches, sampler, state, args.steps, args.batch * args.seq,
                      ProgressBar(args.steps, args.progress and rank == 0), hook)
    except RuntimeError as e:
        if world == 1 or not comm_error(e):
            raise
        print(lost_contact(rank, state, hook, args, e), file=sys.stderr, flush=True)
        os._exit(1)  # no process-group teardown: it would wait on the lost rank
    elapsed = time.perf_counter() - t0
    done = max(args.steps - first, 1)
    if rank == 0:
        print(f"{args.steps - first} steps in {elapsed:.1f}s ({elapsed / done * 1e3:.0f} ms/step), "
              f"final loss {state.losses[-1]:.4f}")
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(state.losses, f)
    if not args.check:
        return 0
    params = full_params(model)
    verdict: list[Any] = [True]
    if rank == 0:
        assert reference is not None
        ref_losses = reference_run(reference, data, args)
        ok, table = compare(state.losses, ref_losses, params, full_params(reference), BF16_RTOL if args.bf16 else RTOL,
                            model_wide=args.bf16)
        print(f"comparison with the single-process run (seed {args.seed}):\n{table}")
        verdict = [ok]
    if world > 1:
        dist.broadcast_object_list(verdict, src=0)
    if not verdict[0]:
        print(f"rank {rank}: the distributed run differs from the single-process run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
