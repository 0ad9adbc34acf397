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


class _Reads(nn.Module):
    flag = True  # a class value

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 2.0
        self.step = 0
        self.cfg = {"mode": "a"}
        self.log = {"seen": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * self.scale
        return y if self.flag and self.cfg["mode"] == "a" else -y


def _read_by_forward(m: _Reads) -> tuple[signature.Tree, attributes.Reads]:
    tree = signature.tree(m)
    reads = attributes.Reads(tree.modules)
    with reads:
        m(torch.ones(1, 4))
    return tree, reads


def test_a_program_serves_calls_differing_only_in_values_its_capture_did_not_read() -> None:
    m = _Reads()
    tree, reads = _read_by_forward(m)
    rest, values = signature.split_values(tree.module_parts)
    assert values[0][0][-5:] == ("scale", "step", "cfg", "log", "flag")
    assert rest[0][1] == values[0][0]  # the names stay in the key
    alike = attributes.Alike()

    def find(other: str, module: torch.nn.Module) -> object:
        return alike.find(*signature.alike_parts(other, signature.tree(module).module_parts))

    alike.keep(*signature.alike_parts("other", tree.module_parts), reads, "program")
    m.step, m.log = 5, {"seen": [1, 2]}  # written by a loop, never read: served
    assert find("other", m) == "program"
    assert find("another", m) is None
    for change in (lambda: setattr(m, "scale", 3.0), lambda: m.cfg.update(mode="b"),
                   lambda: setattr(m, "flag", False), lambda: setattr(m, "extra", 1)):
        m = _Reads()
        change()
        assert find("other", m) is None  # read (or a new name): not served
    _Reads.flag = False  # a class value read
    try:
        assert find("other", _Reads()) is None
    finally:
        _Reads.flag = True
