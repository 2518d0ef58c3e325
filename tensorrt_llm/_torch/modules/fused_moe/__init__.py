"""The fused MoE in Triton: routed experts as two grouped GEMMs over slots sorted by expert."""
