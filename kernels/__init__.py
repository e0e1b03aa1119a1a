"""Attention backends and fused small ops. Each kernel has a torch reference beside it."""
