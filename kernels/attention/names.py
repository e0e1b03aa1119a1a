"""The attention backends' names, the one place they are spelled. Torch-free, so the engine flags
(scheduler_svc/common/config.py, invariant 3) offer them as choices without importing a backend."""

AUTO = "auto"
TORCH = "torch"
TRITON = "triton"
FLASH_ATTN = "flash_attn"

ATTENTION_BACKEND_CHOICES = (AUTO, TORCH, TRITON, FLASH_ATTN)
