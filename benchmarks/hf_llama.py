"""Step time of an unmodified transformers Llama: ours vs torch's tensor parallelism, same world.

    python -m benchmarks.hf_llama                       # TP (4) and DPxTP (2 x 2), eager, 4 gloo ranks
    python -m benchmarks.hf_llama --layouts TP --rounds 5 --steps 3

Model: ``LlamaForCausalLM``, hidden 256, 4 layers, 8 heads, 4 key/value heads, MLP 512, vocabulary
512, batch 8 x 128 tokens, AdamW. Layouts (4 ranks, CPU, one thread each):

=========  ==============================================  ==============================================
layout     ours                                            torch
=========  ==============================================  ==============================================
TP         ``ap.parallelize(model, mesh, ap.plans.llama)``  ``parallelize_module``: q/k/v/gate/up Colwise,
                                                           o/down Rowwise, embedding Rowwise (vocab),
                                                           lm_head Colwise to ``Shard(-1)``, loss_parallel
DPxTP      the same on a 2 x 2 ``dp, tp`` mesh +            the same on ``mesh["tp"]`` + ``replicate``
           ``ap.shard_optimizer``                           (FSDP-style DDP) on ``mesh["dp"]``
=========  ==============================================  ==============================================

Both sides are built in the same processes and timed in alternating rounds (``--rounds``, each
``--steps`` steps after ``--warmup``); the table gives the median seconds per step over rounds
(the slowest rank per round) and the ratio ours / torch. Both compute the same shifted
cross-entropy; the first losses are printed to show the two agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._spawn import run_spawned  # noqa: E402

WORLD = 4


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=512, vocab_size=512, max_position_embeddings=256, attn_implementation="sdpa")


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The causal LM loss: position t predicts token t + 1."""
    v = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))


def build_ours(layout: str, ids: torch.Tensor) -> Any:
    from transformers import LlamaForCausalLM

    import autoparallel as ap

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    if layout == "TP":
        mesh, batch = ap.ProcessMesh(list(range(WORLD)), dim_names=["tp"]), [ap.Replicate()]
    else:
        mesh, batch = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"]), [ap.Shard(0), ap.Replicate()]
    ap.parallelize(model, mesh, ap.plans.llama(model))
    opt = ap.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = ap.shard_tensor(ids, mesh, batch)

    def step() -> float:
        loss = _loss(model(input_ids=x).logits, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach().full_tensor())

    return step


def build_torch(layout: str, ids: torch.Tensor) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    plan: dict[str, Any] = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for p in ("q", "k", "v"):
        plan[f"model.layers.*.self_attn.{p}_proj"] = ColwiseParallel()
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    plan["model.layers.*.mlp.gate_proj"] = ColwiseParallel()
    plan["model.layers.*.mlp.up_proj"] = ColwiseParallel()
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    # after the column split each rank's q/k/v hold its heads: HF reshapes with -1 heads (local)
    x = ids
    if layout == "TP":
        parallelize_module(model, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",)), plan)
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        replicate(model, mesh=mesh["dp"])
        half = ids.shape[0] // 2
        lo = mesh["dp"].get_local_rank() * half
        x = ids[lo:lo + half]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        with loss_parallel():
            loss = _loss(model(input_ids=x).logits, x)
            loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach()
        value = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
        dist.all_reduce(value)  # under DPxTP each dp half holds its own mean (tp ranks agree)
        return float(value) / WORLD

    return step


def _timed(step: Any, steps: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def _worker(rank: int, world: int, store: str, opts: dict[str, Any], out: str) -> None:
    import json

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    ids = torch.randint(0, 512, (8, 128), generator=torch.Generator().manual_seed(1))
    results: dict[str, Any] = {}
    for layout in opts["layouts"]:
        sides = {"ours": build_ours(layout, ids), "torch": build_torch(layout, ids)}
        first = {name: [step() for _ in range(opts["warmup"])] for name, step in sides.items()}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(opts["rounds"]):
            for name, step in sides.items():
                times[name].append(_timed(step, opts["steps"]))
        results[layout] = {"first_losses": first, "median_s": {n: statistics.median(t) for n, t in times.items()}}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["TP", "DPxTP"], choices=["TP", "DPxTP"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    opts = {"layouts": args.layouts, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup}
    res = run_spawned(_worker, WORLD, opts, args.timeout, "ap_hf_llama_")
    print(f"{'layout':8} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10}   first losses (ours | torch)")
    for layout, r in res.items():
        o, t = r["median_s"]["ours"], r["median_s"]["torch"]
        print(f"{layout:8} {o * 1e3:9.1f} {t * 1e3:9.1f} {o / t:10.2f}   {r['first_losses']['ours'][0]:.4f} | "
              f"{r['first_losses']['torch'][0]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
