"""``autoparallel.known_sums``: a note on a shard counts once bound to its DistTensor, and not
after either was written in place; a copy of the shard carries it."""

from __future__ import annotations

import torch

from autoparallel import known_sums


def test_a_note_counts_once_bound_and_until_a_write() -> None:
    shard, wrapper, sums = torch.zeros(3, 4), torch.zeros(3, 4), torch.ones(3, 1)
    known_sums.note(shard, 1, sums)
    assert known_sums.known(shard, 1) is None  # not bound to a DistTensor yet
    known_sums.bind(shard, wrapper)
    assert known_sums.known(shard, 1) is sums and known_sums.known(shard, 0) is None
    known_sums.check(shard, wrapper)
    assert known_sums.known(shard, 1) is sums
    copy = known_sums.carry(shard, shard.clone())
    assert known_sums.known(copy, 1) is sums
    wrapper.mul_(2)  # the DistTensor written in place (autograd's version counter moves)
    known_sums.check(shard, wrapper)
    assert known_sums.known(shard, 1) is None
    known_sums.check(copy, wrapper)
    assert known_sums.known(copy, 1) is None
    shard2 = known_sums.note(torch.zeros(2), 0, torch.ones(1))
    known_sums.bind(shard2, wrapper)
    shard2.add_(1)  # the shard itself written
    assert known_sums.known(shard2, 0) is None
