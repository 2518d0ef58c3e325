"""FP8 with 128 x 128 block scales (DeepSeek-V3's format, as MiniMax-M3's FP8 checkpoints ship)."""
