"""Known failures of ours in the op_db conformance test: ``{(op, variant, phase): reason}``.

``op`` is the OpInfo name (``name.variant_test_name``), ``variant`` one of replicate, shard0,
shard_last, uneven (``"*"``: every variant), ``phase`` forward or backward. Only clear failures
(the op raised, or hung) are listed: a WRONG (silently incorrect) result is never acceptable.
A backward that failed because its forward failed is covered by the forward's entry.

Regenerate from a run (entries of cases not run are kept)::

    python benchmarks/op_coverage.py --backends ours --write-known-failures

``EXCLUDED``: ops not run at all (too slow, or they touch global state), with the reason.
"""

EXCLUDED: dict[str, str] = {
}

KNOWN_FAILURES: dict[tuple[str, str, str], str] = {
    ('__getitem__', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (2,); make it a DistTensor first (ap.shard_tensor)',
    ('_batch_norm_with_update', '*', 'forward'): 'RuntimeError: aten._batch_norm_with_update.default changes the shape of a DistTensor in place ((5,) -> (5, 5, 5)); use the out-of-place op instead',
    ('_native_batch_norm_legit', '*', 'forward'): 'RuntimeError: aten._native_batch_norm_legit.default changes the shape of a DistTensor in place ((5,) -> (5, 5, 5)); use the out-of-place op instead',
    ('combinations', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1,); make it a DistTensor first (ap.shard_tensor)',
    ('cummax', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (5, 5, 5); make it a DistTensor first (ap.shard_tensor)',
    ('cummin', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (5, 5, 5); make it a DistTensor first (ap.shard_tensor)',
    ('diagonal_scatter', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (10,); make it a DistTensor first (ap.shard_tensor)',
    ('linalg.householder_product', 'shard0', 'backward'): 'RuntimeError: aten.fill_.Scalar: in-place write to a view of a DistTensor whose layout had to change to take the view (e.g. slicing a sharded dim); the write would not reach the original tensor. Reshard the original first (e.g. to Replic...',
    ('linalg.matrix_power', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1, 1); make it a DistTensor first (ap.shard_tensor)',
    ('linalg.matrix_rank', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1,); make it a DistTensor first (ap.shard_tensor)',
    ('linalg.matrix_rank.hermitian', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1,); make it a DistTensor first (ap.shard_tensor)',
    ('linalg.vander', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (5, 4); make it a DistTensor first (ap.shard_tensor)',
    ('masked.cumprod', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (5,); make it a DistTensor first (ap.shard_tensor)',
    ('masked.prod', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1,); make it a DistTensor first (ap.shard_tensor)',
    ('masked.std', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1, 1, 1); make it a DistTensor first (ap.shard_tensor)',
    ('masked.var', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1, 1, 1); make it a DistTensor first (ap.shard_tensor)',
    ('mvlgamma.mvlgamma_p_1', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1,); make it a DistTensor first (ap.shard_tensor)',
    ('mvlgamma.mvlgamma_p_3', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1,); make it a DistTensor first (ap.shard_tensor)',
    ('mvlgamma.mvlgamma_p_5', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1,); make it a DistTensor first (ap.shard_tensor)',
    ('nanquantile', '*', 'forward'): 'RuntimeError: aten.squeeze_.dim changes the shape of a DistTensor in place ((1,) -> ()); use the out-of-place op instead',
    ('native_group_norm', '*', 'backward'): 'RuntimeError: aten.unsqueeze_.default changes the shape of a DistTensor in place ((1, 2, 3) -> (1, 2, 3, 1)); use the out-of-place op instead',
    ('nn.functional.fractional_max_pool2d', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1, 3, 2); make it a DistTensor first (ap.shard_tensor)',
    ('nn.functional.fractional_max_pool3d', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (2, 3, 3); make it a DistTensor first (ap.shard_tensor)',
    ('nn.functional.linear_cross_entropy', '*', 'forward'): 'RuntimeError: aten.squeeze_.dim changes the shape of a DistTensor in place ((1, 4) -> (4,)); use the out-of-place op instead',
    ('nn.functional.linear_cross_entropy.chunked_none', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (1, 4); make it a DistTensor first (ap.shard_tensor)',
    ('nn.functional.scaled_dot_product_attention', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (3, 6); make it a DistTensor first (ap.shard_tensor)',
    ('pca_lowrank', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (3, 2); make it a DistTensor first (ap.shard_tensor)',
    ('put', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (3,); make it a DistTensor first (ap.shard_tensor)',
    ('quantile', '*', 'forward'): 'RuntimeError: aten.squeeze_.dim changes the shape of a DistTensor in place ((1,) -> ()); use the out-of-place op instead',
    ('resize_', '*', 'forward'): 'RuntimeError: aten.resize_.default changes the shape of a DistTensor in place ((5, 5, 5) -> (25, 5)); use the out-of-place op instead',
    ('short', 'shard0', 'forward'): 'RuntimeError: Invalid scalar type',
    ('short', 'shard_last', 'forward'): 'RuntimeError: Invalid scalar type',
    ('short', 'uneven', 'forward'): 'RuntimeError: Invalid scalar type',
    ('sparse.mm.reduce', '*', 'forward'): 'hang: WorkerError: worker_run_op: worker(s) died (rank: exitcode) {0: -6, 1: -6, 2: -6}; world will restart',
    ('sparse.mm.reduce', 'replicate', 'backward'): 'hang: WorkerError: worker_run_op: worker(s) died (rank: exitcode) {0: -6, 1: -6, 2: -6}; world will restart',
    ('sparse.sampled_addmm', '*', 'forward'): 'hang: WorkerError: worker_run_op: worker(s) died (rank: exitcode) {0: -6, 1: -6, 2: -6, 3: -6}; world will restart',
    ('sparse.sampled_addmm', 'replicate', 'backward'): 'hang: WorkerError: worker_run_op: worker(s) died (rank: exitcode) {0: -6, 1: -6, 2: -6, 3: -6}; world will restart',
    ('stft', '*', 'forward'): 'RuntimeError: aten.transpose_.default changes the shape of a DistTensor in place ((1, 51, 6) -> (1, 6, 51)); use the out-of-place op instead',
    ('svd_lowrank', '*', 'forward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (3, 2); make it a DistTensor first (ap.shard_tensor)',
    ('tensor_split', '*', 'forward'): 'RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet.',
    ('to_sparse', '*', 'forward'): "NotImplementedError: Could not run 'aten::view' with arguments from the 'SparseCPU' backend. This could be because the operator doesn't exist for this backend, or was omitted during the selective/custom build process (if using custom bui...",
    ('trace', '*', 'backward'): 'TypeError: cannot mix a DistTensor with a plain tensor of shape (25,); make it a DistTensor first (ap.shard_tensor)',
}
