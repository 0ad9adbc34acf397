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
    ('resize_', '*', 'forward'): 'RuntimeError: aten.resize_.default changes the shape of a DistTensor in place ((5, 5, 5) -> (25, 5)); use the out-of-place op instead',
    ('sparse.mm.reduce', '*', 'forward'): 'RuntimeError: Sparse CSR tensors do not have is_contiguous',
    ('sparse.sampled_addmm', '*', 'forward'): 'RuntimeError: Sparse CSR tensors do not have is_contiguous',
    ('to_sparse', '*', 'forward'): "NotImplementedError: Could not run 'aten::view' with arguments from the 'SparseCPU' backend. This could be because the operator doesn't exist for this backend, or was omitted during the selective/custom build process (if using custom bui...",
}
