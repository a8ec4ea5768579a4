"""Attention backends (torch reference, Triton, flash-attn) and the DCP combine."""
