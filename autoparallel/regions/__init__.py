"""Local regions: run a module call as one captured program on the local shards.

Op by op, every op on DistTensors pays the engine's dispatch (a rule, a plan, a wrap). A module's
forward and backward change nothing from call to call of one *signature* (the layouts of its
arguments, parameters and buffers, the train/eval flags, plain attribute values, grad mode,
autocast and the non-tensor arguments), so ``enable_local_regions(model)`` (which
``shard_layer`` and ``parallelize`` call) installs a wrapper on ``model.forward`` that records the
call of a new signature once, on fake tensors, with the engine planning every op as in eager mode
(``static.capture``, the capture ``ap.to_static`` uses), collectives included, and runs every
call of that signature — the first, the later ones and a recomputation inside
``torch.utils.checkpoint`` — as that program on the shards, in one autograd node
(``regions.program``). A signature met at a second size is captured with the sizes of its tensor
arguments open, and serves the sizes its guards admit.

What a program cannot hold (a Python value read from a tensor, an op without a rule, a forward
that writes one of its arguments in place or assigns module state, a submodule's forward hook,
an object returned) is found during the capture: the call is *refused*, runs on DistTensors op by
op, and the module's children are tried as regions in turn. Every decision reads metadata only:
all ranks reach the same one. ``local_regions_report(model)`` says, per module and signature,
``local`` or ``refused: why``; ``AUTOPARALLEL_LOCAL_REGIONS=0`` turns the feature off.
"""

from autoparallel.regions.region import disable_local_regions, enable_local_regions, local_regions_report

__all__ = ["disable_local_regions", "enable_local_regions", "local_regions_report"]
