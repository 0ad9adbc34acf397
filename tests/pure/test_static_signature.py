"""The signature a captured step is kept under, read in one walk of the module tree
(``autoparallel.static.signature.tree``): the parameters and buffers as ``module.parameters()``
and ``module.buffers()`` list them (ties and a shared submodule once, empty slots skipped), and
the key's parts telling apart what a replay depends on."""

from __future__ import annotations

import torch
from torch import nn

from autoparallel import attributes, compat
from autoparallel.static import signature


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.shared = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Sequential(self.shared, nn.LayerNorm(4)), nn.BatchNorm1d(4)])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.empty = None
        self.register_buffer("scale", torch.ones(4))
        self.register_parameter("unused", None)
        self.temperature = 0.5


def _reference(m: nn.Module) -> tuple[tuple[object, ...], ...]:
    return (tuple((None, p.requires_grad) for p in m.parameters()),
            tuple((name, signature.leaf(b)) for name, b in m.named_buffers()),
            tuple((x.training, tuple((k, type(v), v) for k, v in compat.module_values(x)), attributes.held(x, {}),
                   attributes.class_values(type(x)), *compat.module_hooks(x))
                  for x in m.modules()))


def test_one_walk_lists_what_the_module_walks_list() -> None:
    m = _Net()
    tree = signature.tree(m)
    assert [id(p) for p in tree.params] == [id(p) for p in m.parameters()]
    assert [id(b) for b in tree.buffers] == [id(b) for b in m.buffers()]
    assert tree.key == _reference(m)
    assert len(tree.module_parts) == len(list(m.named_modules()))  # ``changed`` names modules by that walk


def test_the_key_changes_with_what_a_replay_depends_on() -> None:
    m = _Net()
    base = signature.tree(m).key
    assert signature.tree(m).key == base
    changes = [
        lambda: setattr(m, "temperature", 0.7),  # a plain value a forward may compute with
        lambda: setattr(m.blocks[1], "momentum", 1),  # 0.1 -> 1: a value and its type
        lambda: m.blocks[0].eval(),  # a train/eval flag
        lambda: m.shared.register_forward_hook(lambda *a: None),  # a hook
        lambda: m.head.weight.requires_grad_(False),  # a frozen parameter
        lambda: setattr(m, "scale", torch.ones(5)),  # a buffer of another shape
        lambda: setattr(m, "config", {"scale": 1.0}),  # an object held
        lambda: m.config.update(scale=2.0),  # a value inside it
    ]
    seen = {base}
    for change in changes:
        change()
        key = signature.tree(m).key
        assert key not in seen, change
        assert key == _reference(m)
        seen.add(key)


def test_a_flag_set_to_one_is_not_true() -> None:
    m, n = _Net(), _Net()
    m.flag, n.flag = True, 1
    assert signature.tree(m).key != signature.tree(n).key
