"""Ops tagged ``torch.Tag.pointwise`` that no table names get the plain sharded rule.

Found by the model zoo: BERT's extended attention mask is ``(1.0 - mask) * min``, i.e.
``aten.rsub.Scalar``, which had no rule, so under data parallelism every step all-gathered the
batch-sharded mask (the fallback). 261 pointwise overloads had no rule; now only their ``out=``
variants do not.
"""

from __future__ import annotations

import torch

from autoparallel import Partial, Replicate, Shard
from spmd_rules import get_rule
from tests.pure.test_rules import make_call, offers, outputs_for

aten = torch.ops.aten
S0, R, P = Shard(0), Replicate(), Partial()


def test_rsub_scalar_stays_sharded() -> None:
    mask = torch.ones(4, 6)
    call = make_call(aten.rsub.Scalar, (mask, 1.0), [S0])
    assert offers(call, [S0], [S0]) and offers(call, [R], [R])
    assert outputs_for(call, [P]) == []  # 1 - x is not linear: no Partial through it


def test_every_pointwise_overload_but_out_variants_has_a_rule() -> None:
    missing = []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload)
            if torch.Tag.pointwise not in op.tags:
                continue
            out_variant = any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
                              for a in op._schema.arguments)
            if get_rule(op) is None and not out_variant:
                missing.append(str(op))
    assert not missing, missing


def test_a_named_rule_wins_over_the_tag() -> None:
    call = make_call(aten.add.Tensor, (torch.ones(4, 6), torch.ones(4, 6)), [P, P])
    assert offers(call, [P, P], [P])  # add's own rule (linear), not the tag's
