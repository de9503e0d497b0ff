"""The rewrites, one per module, as pure functions of an FX graph.

- :mod:`.results`: the typed results (`FusionKind`, `SkipCode`, `Skip`, `SkipRecord`)
  and the `Rewrite` interface every rewrite implements (`name`, `plan`, `apply`);
- :mod:`.norm_quant`: rewrite 1, Gemma norm -> MXFP8 quant into one fused op;
- :mod:`.sp_gather` (plan) and :mod:`.sp_gather_apply` (graph edits), with the guards in
  :mod:`.gather_checks`: rewrite 2, quantization around the sequence-parallel all-gather;
- :mod:`.norms`, :mod:`.quants`, :mod:`.collectives`: recognizers they share.
"""
