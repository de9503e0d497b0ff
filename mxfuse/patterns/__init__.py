"""The rewrites, one per module, as pure functions of an FX graph.

- :mod:`.results`: the contract: `FusionKind`, `RefusalCode` / `SharedCode` / `Scope`,
  `Reason`, `Skip` / `SkipRecord`, and the `Rewrite` interface (`name`, `plan`, `apply`);
- recognizers: :mod:`.norms` and :mod:`.hf_norm` (norms → `NormMatch`), :mod:`.quants`
  and :mod:`.torchao_quant` (quants → the `QuantSite` protocol), :mod:`.collectives`
  (all-gathers) and :mod:`.all_reduces`; :mod:`.allreduce_norm` (norms vLLM's all-reduce fusion
  took first: recognized, refused); :mod:`.fx_utils`: small node helpers;
- rewrite 0, :mod:`.sequence_parallel` (its graph building in :mod:`.sp_emit`);
- rewrite 1, :mod:`.norm_quant`;
- rewrite 2, :mod:`.sp_gather` (plan), :mod:`.gather_checks` (its guards and codes),
  :mod:`.sp_gather_apply` (its graph edits).
"""
