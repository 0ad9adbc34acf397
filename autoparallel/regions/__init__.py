"""Local regions: run a module on local shards when its DistTensor execution moves no data.

A module whose every op, run on DistTensors, takes its inputs as they are (no reshard, no
collective, no fallback, no random op) computes on each rank exactly what the same module run
on the rank's local shards computes: that is what an SPMD rule's "as-is" strategy means. For
such a module the per-op dispatch is pure overhead. ``enable_local_regions(model)`` installs a
wrapper on ``model.forward`` that finds out, once per *signature* (the layouts of the arguments,
parameters and buffers, the training flags, grad mode and non-tensor arguments), whether the
module is such a region, and from then on runs it on local tensors:

1. **Trace** (first call of a signature): run the module on DistTensors as usual, recording
   every decision and the aten calls made on local shards; any moved input, collective,
   fallback, value op or random op refuses the signature.
2. **Classify** the outputs: no Partial; on each mesh axis either every output is sharded
   (the ranks along it computed disjoint pieces) or every input is Replicate (they computed
   the same thing). This gives each input's gradient layout: a Replicate input (a parameter
   of a data-parallel model) used on a sharded axis gets a Partial(sum) gradient there.
3. **Replay** the module once on copies of the local shards (RNG restored) and require the
   very same aten calls with the same shapes and non-tensor arguments. This catches Python
   code that reads global sizes (``x / x.shape[0]``), hooks that reshard, and anything that
   behaves differently on plain tensors.

Every check reads metadata only (shards must be even, so all ranks see identical local
shapes): all ranks reach the same verdict. A refused module has the wrapper installed on its
children, which are tried in turn (a data-parallel GPT runs as one region; a tensor-parallel
block's column-parallel Linear and its sequence-parallel LayerNorm become regions, its
row-parallel Linear does not). ``AUTOPARALLEL_LOCAL_REGIONS=0`` turns the feature off.

``AUTOPARALLEL_LOCAL_REGIONS=capture`` (a preview) replaces the three steps by one capture
(``regions.program``): a signature's forward and backward recorded once on fake tensors, with
its collectives, and run as one autograd node at every call (docs/local_regions.md).
"""

from autoparallel.regions.region import disable_local_regions, enable_local_regions, local_regions_report

__all__ = ["disable_local_regions", "enable_local_regions", "local_regions_report"]
