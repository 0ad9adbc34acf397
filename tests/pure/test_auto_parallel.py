"""``ap.auto_parallel`` in one process: the step recorded on fake tensors, plans priced on simulated
meshes of any size (no world), the plan readable, savable and editable, bad input refused."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from gpt_model import GPT, GPTConfig, lm_loss  # noqa: E402

import autoparallel as ap  # noqa: E402
from autoparallel.auto.simulate import simulate  # noqa: E402
from autoparallel.auto.trace import trace_step  # noqa: E402

CFG = GPTConfig(vocab=128, width=64, heads=4, layers=2, seq=64)


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (8, 64), generator=g), torch.randint(0, 128, (8, 64), generator=g)


def test_trace_records_forward_backward_and_leaves_the_model_alone() -> None:
    model = GPT(CFG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = trace_step(model, _example(), lm_loss)
    assert any(o.backward for o in step.ops) and any(not o.backward for o in step.ops)
    assert set(step.params) == {n for n, _ in model.named_parameters()}
    assert all(step.grads.get(n) for n, p in model.named_parameters())
    assert step.saved and step.loss is not None
    assert sum(o.flops for o in step.ops) > 0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None


class _SharedEmbedding(nn.Module):
    """T5's shape: one embedding module reached by two paths, a head tied to its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(32, 16)
        self.encoder = nn.Module()
        self.encoder.embed_tokens = self.shared
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder.embed_tokens(x) + self.shared(x)))


def test_recording_leaves_a_module_reached_by_two_paths_whole() -> None:
    """Every parameter and buffer is the same tensor after the search as before (torch's
    functional_call left a fake in a module reached by two paths: T5's shared embedding)."""
    model = _SharedEmbedding()
    before = {n: t for n, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))}
    x = torch.randint(0, 32, (8, 6))
    plan = ap.auto_parallel(model, world=4, example=(x, x),
                            loss=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    assert plan.prediction is not None
    after = {n: t for n, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))}
    assert after.keys() == before.keys()
    assert all(after[n] is t for n, t in before.items()), [n for n, t in before.items() if after[n] is not t]
    assert model(x).shape == (8, 6, 32)  # real tensors: it still runs


class _PlainTable(nn.Module):
    """GPT-J's shape: a table kept as a plain tensor attribute (neither parameter nor buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(6, 16)
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x) + self.table)


def test_a_plain_tensor_attribute_is_recorded_as_a_constant() -> None:
    x = torch.randint(0, 32, (8, 6))
    plan = ap.auto_parallel(_PlainTable(), world=4, example=(x, x),
                            loss=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    assert plan.prediction is not None and plan.prediction.time_s > 0


def test_simulation_counts_megatron_collectives() -> None:
    """Tensor parallel on a simulated mesh of 4: one all-reduce per row-parallel Linear and the
    embedding in the forward; data parallel: no forward collective but the mean loss's."""
    model = GPT(CFG)
    step = trace_step(model, _example(), lm_loss)
    dp = simulate(step, ap.ProcessMesh.simulated((4,), ["dp"]), {}, (ap.Shard(0),))
    assert [c.kind for c in dp.collectives if not c.backward] == ["all_reduce"]
    plan = ap.auto_parallel(model, example=_example(), loss=lm_loss, mesh=ap.ProcessMesh.simulated((4,), ["mp"]))
    assert {"blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.fc", "blocks.*.mlp.proj"} <= set(plan)
    assert type(plan["blocks.*.attn.qkv"]).__name__ == "ColWiseParallel"
    assert type(plan["blocks.*.mlp.proj"]).__name__ == "RowWiseParallel"
    from autoparallel.auto.search import found_plans
    megatron = dict((label, p) for label, p, _ in found_plans(model, step))["megatron"]
    assert type(megatron["tok"]).__name__ == "VocabParallelEmbedding"  # tied to the head
    assert type(megatron["head"]).__name__ == "ColWiseParallel"


@pytest.mark.parametrize("vocab", [128, 32000])
def test_the_vocabulary_is_split_where_it_pays(vocab: int) -> None:
    """Each tensor-parallel plan is also priced with its vocabulary-parallel embedding and head
    left whole: at a vocabulary of 128 that saves the embedding's and the loss's collectives
    (chosen); at 32000 the whole head's compute and gradient cost more (split). Priced for a
    fixed host whose collectives cost 1 ms each (a busy gloo world), not the measured one: the
    choice at 128 is a few per cent either way on this machine, so a measured profile would make
    the test depend on the machine's load."""
    from autoparallel.auto.profile import Profile

    host = Profile("host", 1e10, 2e9, 1e-3, 1e9, 40e-6, kernel_s=5e-6)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (8, 64), generator=g)
    model = GPT(GPTConfig(vocab=vocab, width=64, heads=4, layers=2, seq=64))
    plan = ap.auto_parallel(model, example=(x, x), loss=lm_loss, mesh=ap.ProcessMesh.simulated((4,), ["mp"]),
                            profile=host)
    names = {c.name for c in plan.candidates}
    assert {"dp1 x tp4 megatron", "dp1 x tp4 megatron, vocabulary whole"} <= names
    whole = plan.candidates[0].name.endswith("vocabulary whole")
    assert whole == (vocab == 128), plan.candidates[0].name
    assert ("tok" in plan) == (vocab == 32000) and ("head" in plan) == (vocab == 32000)
    if whole:
        assert plan.divisible and not any("num_embeddings" in k for k in plan.divisible)


@pytest.mark.parametrize("world", [4, 8, 64, 512])
def test_search_on_simulated_worlds(world: int) -> None:
    plan = ap.auto_parallel(GPT(CFG), world=world, example=_example(), loss=lm_loss)
    assert int(torch.tensor(plan.mesh_shape).prod()) == world
    assert plan.prediction is not None and plan.prediction.time_s > 0
    assert plan.candidates and plan.candidates[0].prediction.time_s <= plan.candidates[-1].prediction.time_s
    text = str(plan)
    assert "mesh" in text and "candidates" in text and "predicted" in text


def test_zero_stages_are_priced_with_the_collectives_they_issue() -> None:
    """A ZeRO-3 step issues an all-gather per block in forward and again in backward, one for the
    root unit (kept for its backward), and a reduce-scatter per unit; ZeRO-2 one all-gather and
    one reduce-scatter per bucket; DP one all-reduce per bucket, and ZeRO-1 (whole gradients) the
    same plus one all-gather (tests/models/zoo.py pins the measured counts: 5 all-gathers, 3
    reduce-scatters for 2 blocks with ZeRO-3; an all-gather and the all-reduces with ZeRO-1)."""
    plan = ap.auto_parallel(GPT(CFG), world=4, example=_example(), loss=lm_loss, profile="h100")
    by = {c.name: c.prediction for c in plan.candidates}
    dp, z1, z2, z3 = by["dp4 x tp1"], by["dp4 x tp1 zero1"], by["dp4 x tp1 zero2"], by["dp4 x tp1 zero3"]
    assert z1.collectives - dp.collectives == 1  # the all-gather of the updated shards
    assert z1.comm_bytes - dp.comm_bytes == pytest.approx(dp.comm_bytes / 2, rel=1e-3)  # (half the all-reduce)
    assert z2.collectives - dp.collectives == 1  # the all-reduce -> a reduce-scatter and an all-gather
    assert z3.collectives - dp.collectives == (2 * CFG.layers + 1) + (CFG.layers + 1) - 1
    # bytes: ZeRO-2 gathers the parameters once, ZeRO-3 the blocks twice and the root once
    assert z2.comm_bytes < z3.comm_bytes < 2 * z2.comm_bytes


def test_the_optimizer_update_is_priced_on_the_shard_a_rank_steps() -> None:
    """The update reads and writes each parameter's states: AdamW (two states) costs more than
    plain SGD, and from ZeRO-1 on a rank updates only its shard (ZeRO-1/2 then copy the gathered
    parameters back, still less than the whole update)."""
    model, ex = GPT(CFG), _example()
    by = {opt: {c.name: c.prediction for c in ap.auto_parallel(model, world=4, example=ex, loss=lm_loss, profile="h100",
                                                               optimizer=opt).candidates}
          for opt in ("adamw", "sgd")}
    adam, sgd = by["adamw"], by["sgd"]
    for name in ("dp4 x tp1", "dp4 x tp1 zero1", "dp4 x tp1 zero3"):
        assert adam[name].compute_s > sgd[name].compute_s and adam[name].overhead_s > sgd[name].overhead_s, name
    assert adam["dp4 x tp1 zero1"].compute_s < adam["dp4 x tp1"].compute_s
    assert adam["dp4 x tp1 zero3"].compute_s < adam["dp4 x tp1 zero1"].compute_s


def test_plan_saves_loads_and_applies_its_parts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = ap.auto_parallel(GPT(CFG), example=_example(), loss=lm_loss, mesh=ap.ProcessMesh.simulated((2, 2), ["dp", "mp"]))
    path = str(tmp_path / "plan.json")
    plan.save(path)
    back = ap.Plan.load(path)
    assert back.mesh_shape == plan.mesh_shape and back.dim_names == plan.dim_names and back.zero == plan.zero
    assert {k: repr(v) for k, v in back.items()} == {k: repr(v) for k, v in plan.items()}
    assert back.recompute == plan.recompute


def test_memory_budget_is_kept_or_refused_with_the_smallest() -> None:
    model, ex = GPT(CFG), _example()
    free = ap.auto_parallel(model, world=4, example=ex, loss=lm_loss)
    assert free.prediction is not None
    tight = ap.auto_parallel(model, world=4, example=ex, loss=lm_loss, memory_budget=int(free.prediction.memory_bytes * 0.8))
    assert tight.prediction is not None and tight.prediction.memory_bytes <= free.prediction.memory_bytes * 0.8
    with pytest.raises(ValueError, match="smallest predicted peak"):
        ap.auto_parallel(model, world=4, example=ex, loss=lm_loss, memory_budget="1KiB")


def test_transformers_family_plan_is_used() -> None:
    pytest.importorskip("transformers")
    from tests.models.test_hf_llama import tiny_llama
    model = tiny_llama()
    ids = torch.randint(0, 128, (4, 16))
    plan = ap.auto_parallel(model, world=2, example={"input_ids": ids, "labels": ids},
                            mesh=ap.ProcessMesh.simulated((2,), ["mp"]))
    assert type(plan["*.self_attn.q_proj"]).__name__ == "ColWiseParallel"
    assert type(plan["*.mlp.down_proj"]).__name__ == "RowWiseParallel"


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.sum() if y.sum() > 0 else -y.sum()  # Python reads a tensor's value


class _Summed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()  # one Linear: no column/row pair to split


def test_transformers_sdpa_mask_check_is_named_with_the_way_around(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The all-ones mask check of transformers' sdpa attention reads a value: the error says so
    and names ``attn_implementation="eager"`` (a module of that file name stands in for it)."""
    (tmp_path / "modeling_attn_mask_utils.py").write_text(
        "import torch\n\ndef prepare(mask):\n    if torch.all(mask == 1):\n        return None\n    return mask\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import modeling_attn_mask_utils as mask_utils

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask_utils.prepare(torch.ones(2))
            return self.lin(x).sum()

    with pytest.raises(ValueError, match=r"modeling_attn_mask_utils.py:4 .*attn_implementation=\"eager\""):
        ap.auto_parallel(Masked(), world=2, example=(torch.randn(2, 4),))


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"cannot be traced .*test_auto_parallel.py:\d+ \(`return y.sum\(\) if y.sum\(\) > 0"):
        ap.auto_parallel(_DataDependent(), world=2, example=(torch.randn(2, 4),))  # names the model's line
    with pytest.raises(ValueError, match="no scalar loss"):
        ap.auto_parallel(nn.Linear(4, 4), world=2, example=(torch.randn(2, 4),))
    with pytest.raises(ValueError, match="memory_budget"):
        ap.auto_parallel(GPT(CFG), world=2, example=_example(), loss=lm_loss, memory_budget="lots")
    with pytest.raises(ValueError, match="world"):
        ap.auto_parallel(GPT(CFG), world=0, example=_example(), loss=lm_loss)
    with pytest.raises(TypeError, match="nn.Module"):
        ap.auto_parallel(lambda x: x, world=2, example=_example())  # type: ignore[arg-type]
    laid = nn.Linear(4, 4)
    laid.weight = ap.shard_tensor(laid.weight, ap.ProcessMesh([0]), [ap.Replicate()])  # type: ignore[assignment]
    with pytest.raises(ValueError, match="mesh"):  # laid out on 1 rank, a world of 2
        ap.auto_parallel(laid, world=2, example=(torch.randn(2, 4),))
    with pytest.raises(ValueError, match="optimizer"):
        ap.auto_parallel(GPT(CFG), world=2, example=_example(), loss=lm_loss, optimizer="mystery")
    dp_mp = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    with pytest.raises(ValueError, match=r"no plan for the given mesh's tensor-parallel axis of 2: no tensor-parallel "
                                         r"plan was found for this model .*pass mesh=None"):
        ap.auto_parallel(_Summed(), world=4, example=(torch.randn(4, 4),), mesh=dp_mp)


@pytest.mark.parametrize("world", [8, 64])
def test_repeated_blocks_recorded_twice_price_like_all(world: int) -> None:
    """A stack of identical blocks recorded with two and three of them prices every candidate as
    recording all of them does (time and collectives exactly; the peak memory exactly without
    recompute, within 5 % with it: where the peak falls in the step may move with depth), and
    leaves the model whole."""
    from autoparallel.auto.repeat import record, repeated_blocks

    model = GPT(GPTConfig(vocab=128, width=64, heads=4, layers=5, seq=64))
    assert repeated_blocks(model) == ("blocks", 5)
    recording = record(model, _example(), lm_loss)
    assert recording.two is not None and len(model.blocks) == 5
    assert set(recording.step.params) == {n for n, _ in model.named_parameters()}
    plans = {ex: ap.auto_parallel(model, world=world, example=_example(), loss=lm_loss, profile="h100",
                                  extrapolate=ex) for ex in (False, True)}
    whole = {c.name: c.prediction for c in plans[False].candidates}
    cut = {c.name: c.prediction for c in plans[True].candidates}
    assert whole.keys() == cut.keys()
    for name, p in whole.items():
        q = cut[name]
        assert (p.collectives, p.comm_bytes) == (q.collectives, q.comm_bytes), name
        if "recompute" in name:
            assert q.memory_bytes == pytest.approx(p.memory_bytes, rel=0.05), name
        else:
            assert q.memory_bytes == p.memory_bytes, name
        assert p.time_s == pytest.approx(q.time_s, rel=1e-9), name
    assert plans[True].recompute == plans[False].recompute


def test_blocks_sharing_a_parameter_are_recorded_whole() -> None:
    from autoparallel.auto.repeat import record, repeated_blocks

    model = GPT(GPTConfig(vocab=128, width=64, heads=4, layers=4, seq=64))
    for b in model.blocks[1:]:
        b.mlp.fc.weight = model.blocks[0].mlp.fc.weight  # one weight used by every block
    assert repeated_blocks(model) is None
    assert record(model, _example(), lm_loss).two is None


def test_recompute_is_chosen_per_block_to_fit_the_budget() -> None:
    """A budget between recomputing no block and every block: the fewest blocks recomputed that
    fit, named in the plan one by one; the prediction falls with each block recomputed."""
    model = GPT(GPTConfig(vocab=128, width=64, heads=4, layers=4, seq=64))
    mesh = ap.ProcessMesh.simulated((4,), ["dp"])
    free = ap.auto_parallel(model, example=_example(), loss=lm_loss, mesh=mesh, profile="h100")
    by_name = {c.name: c.prediction for c in free.candidates}
    none, full = by_name["dp4 x tp1"].memory_bytes, by_name["dp4 x tp1 recompute"].memory_bytes
    assert full < none
    budget = (none + full) // 2
    plan = ap.auto_parallel(model, example=_example(), loss=lm_loss, mesh=mesh, profile="h100", memory_budget=budget)
    partial = [c for c in plan.candidates if c.name.startswith("dp4 x tp1 recompute ")]
    assert partial and partial[0].feasible and partial[0].prediction.memory_bytes <= budget
    k = int(partial[0].name.rsplit(" ", 1)[-1].split("/")[0])
    assert 0 < k < 4
    if plan.candidates[0].name == partial[0].name:
        assert plan.recompute == {f"blocks.{i}": "full" for i in range(k)}


def test_simulated_backward_reverses_the_styles_moves() -> None:
    """Tensor parallel (Megatron pairs, vocabulary-parallel embedding) on a simulated mesh of 4:
    the backward crosses each column-parallel Linear's input boundary with the reverse of its
    style's move (the gradient, Partial, all-reduced to the input's layout) as eager does: only
    all-reduces, one per pair, one for the embedding and one for the loss's row sums."""
    from autoparallel.auto import search

    model = GPT(CFG)
    step = trace_step(model, _example(), lm_loss)
    label, plan, _ = search.found_plans(model, step)[0]
    assert label == "megatron"
    mesh = ap.ProcessMesh.simulated((4,), ["mp"])
    params, io = search._placements(model, plan, mesh, 0)
    sim = simulate(step, mesh, params, (ap.Replicate(),), io, 0)
    backward = [c for c in sim.collectives if c.backward]
    assert {c.kind for c in backward} == {"all_reduce"}
    assert len(backward) == 2 * CFG.layers + 2
    assert len([c for c in sim.collectives if not c.backward]) == 2 * CFG.layers + 3  # pairs, embedding, loss


def test_profile_prices_axes_inside_a_node_apart() -> None:
    """Nodes of 8 ranks, row-major meshes: an inner axis of up to 8 ranks stays inside a node
    (NVLink), an outer axis crosses nodes; the same bytes cost less inside a node."""
    h = ap.auto.H100
    assert h.inside_node((32, 8), 1) and not h.inside_node((32, 8), 0)
    assert h.inside_node((64, 4), 1) and not h.inside_node((64, 4), 0)
    assert h.inside_node((8,), 0) and not h.inside_node((16,), 0) and not h.inside_node((4, 2), -1)
    assert h.seconds("all_reduce", 2**30, 1, True) < h.seconds("all_reduce", 2**30, 1, False)
    local = ap.auto.Profile("one network", 1e12, 1e11, 1e-4, 1e9)
    assert not local.inside_node((2, 2), 1)


def test_layouts_by_hand_on_two_meshes_or_another_mesh_are_refused() -> None:
    model = GPT(CFG)
    one = ap.ProcessMesh([0], dim_names=["dp"])
    model.blocks[0].mlp.fc.weight = ap.shard_tensor(model.blocks[0].mlp.fc.weight, one, [ap.Replicate()])  # type: ignore[assignment]
    with pytest.raises(ValueError, match="differs from the mesh"):
        ap.auto_parallel(model, example=_example(), loss=lm_loss, mesh=ap.ProcessMesh.simulated((2,), ["dp"]))
    other = ap.ProcessMesh([0], dim_names=["mp"])
    model.blocks[1].mlp.fc.weight = ap.shard_tensor(model.blocks[1].mlp.fc.weight, other, [ap.Replicate()])  # type: ignore[assignment]
    with pytest.raises(ValueError, match="two meshes"):
        ap.auto_parallel(model, example=_example(), loss=lm_loss)


def test_a_model_without_repeated_blocks_gets_a_plan() -> None:
    """No stack of blocks: no recompute candidates, a plan all the same."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 32)
            self.out = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.fc(x)))

    plan = ap.auto_parallel(Net(), world=4, example=(torch.randn(8, 16), torch.randint(0, 4, (8,))),
                            loss=nn.functional.cross_entropy, profile="h100")
    assert plan.recompute == {} and not any("recompute" in c.name for c in plan.candidates)


def _plan_keys_style_only_what_was_priced(plan: ap.Plan, model: nn.Module) -> dict[str, str]:
    """``{module name: style class}`` the plan's keys style (each key matching no root)."""
    from fnmatch import fnmatchcase
    names = [n for n, _ in model.named_modules()]
    styled: dict[str, str] = {}
    for key, style in plan.items():
        assert not fnmatchcase("", key), f"plan key {key!r} styles the whole model"
        for n in names:
            if fnmatchcase(n, key):
                styled[n] = type(style).__name__
    return styled


def test_found_pairs_in_a_top_level_sequential_are_named_exactly() -> None:
    """A ``Sequential``'s children are named ``0, 1, 2``: their index pattern (``*``) would match
    every module and the root, so the pair is keyed by name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 10))
    mesh = ap.ProcessMesh.simulated((2, 2), ["dp", "mp"])
    plan = ap.auto_parallel(model, world=4, mesh=mesh, example=(torch.randn(32, 64), torch.randint(0, 10, (32,))),
                            loss=nn.functional.cross_entropy, profile="h100")
    assert _plan_keys_style_only_what_was_priced(plan, model) == {"0": "ColWiseParallel", "2": "RowWiseParallel"}


class _Lists(nn.Module):
    """A list of unlike Linears (``up``/``down``) and a list of like single-Linear blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.up_down = nn.ModuleList([nn.Linear(16, 64), nn.Linear(64, 16)])
        self.same = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up_down[1](torch.relu(self.up_down[0](x)))
        for layer in self.same:
            x = torch.relu(layer(x))
        return self.head(x)


def test_pairs_across_list_entries_are_named_exactly() -> None:
    """A pair made of two entries of one list (``up_down.0`` -> ``up_down.1``, ``same.0`` ->
    ``same.1``) is not a pair repeated in every entry: each entry is keyed by name."""
    model = _Lists()
    mesh = ap.ProcessMesh.simulated((4,), ["mp"])
    plan = ap.auto_parallel(model, world=4, mesh=mesh, example=(torch.randn(8, 16), torch.randint(0, 4, (8,))),
                            loss=nn.functional.cross_entropy, profile="h100")
    styled = _plan_keys_style_only_what_was_priced(plan, model)
    assert not any("*" in k for k in plan), list(plan)
    assert {n: s for n, s in styled.items() if n in ("up_down.0", "up_down.1", "same.0", "same.1")} == \
        {"up_down.0": "ColWiseParallel", "up_down.1": "RowWiseParallel",
         "same.0": "ColWiseParallel", "same.1": "RowWiseParallel"}, styled


def test_pairs_inside_repeated_blocks_are_one_pattern_each() -> None:
    """A pair inside one block of a stack of copies is keyed by its pattern over the blocks."""
    model = GPT(CFG)
    mesh = ap.ProcessMesh.simulated((2, 2), ["dp", "mp"])
    plan = ap.auto_parallel(model, world=4, mesh=mesh, example=_example(), loss=lm_loss, profile="h100")
    wild = [k for k in plan if "*" in k]
    assert wild and all(k.startswith("blocks.*.") for k in wild), list(plan)
    styled = _plan_keys_style_only_what_was_priced(plan, model)
    for i in range(CFG.layers):
        assert {n.split(".", 2)[2] for n in styled if n.startswith(f"blocks.{i}.")} == \
            {n.split(".", 2)[2] for n in styled if n.startswith("blocks.0.")}


def test_recompute_of_unlike_blocks_names_them() -> None:
    from autoparallel.auto.search import blocks_pattern
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    modules = dict(model.named_modules())
    assert blocks_pattern(["0", "1", "2"], modules) == ["0", "1", "2"]
    stack = nn.Module()
    stack.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(3)])  # type: ignore[assignment]
    stack.head = nn.Linear(4, 4)  # type: ignore[assignment]
    modules = dict(stack.named_modules())
    assert blocks_pattern(["blocks.0", "blocks.1", "blocks.2"], modules) == ["blocks.*"]
