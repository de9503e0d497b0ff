"""The rewrites, one per module, as pure functions of an FX graph.

- :mod:`.norm_quant`: rewrite 1, Gemma norm -> MXFP8 quant into one fused op;
- :mod:`.sp_gather`: rewrite 2, quantization around the sequence-parallel all-gather;
- :mod:`.norms`, :mod:`.quants`, :mod:`.collectives`: recognizers they share.
"""
