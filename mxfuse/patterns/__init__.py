"""The rewrites, one per module, as pure functions of an FX graph.

- :mod:`.results`: the contract: `FusionKind`, `RefusalCode` (each code with its fix) /
  `SharedCode` / `Scope`, `Reason`, `Skip` / `SkipRecord`, and the `Rewrite` interface
  (`name`, `undo`, `plan`, `apply`);
- producers (what an MXFP8 quant reads): :mod:`.producers` (the `ProducerMatch` protocol,
  the `FUSED_OPS` table, `insert_fused`), :mod:`.producer_registry` (`find_producers` over
  every family); norms: :mod:`.norm_match` (`NormMatch`), :mod:`.norms`, :mod:`.hf_norm`,
  :mod:`.allreduce_norm` (norms vLLM's all-reduce fusion took first: recognized, refused);
- quants (the `QuantSite` protocol): :mod:`.quants`, :mod:`.torchao_quant` and its pattern
  trees :mod:`.torchao_patterns`; collectives: :mod:`.collectives` (all-gathers, and the one
  emitter of either family) and :mod:`.all_reduces`; :mod:`.fx_utils`: small node helpers
  and the one list of each kind of view op;
- rewrite 0, :mod:`.sequence_parallel` (its graph building in :mod:`.sp_emit`);
- rewrite 1, :mod:`.producer_quant` (producer -> quant; named `norm_quant` in reports);
- rewrite 2, :mod:`.sp_gather` (plan), :mod:`.gather_checks` (its guards and codes),
  :mod:`.sp_gather_apply` (its graph edits).
"""
