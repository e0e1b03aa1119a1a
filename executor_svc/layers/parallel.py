"""This process's place in the tensor-parallel group, read from torch.distributed."""
import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def shard_size(total: int, what: str) -> int:
    """Per-rank share of `total`; splitting unevenly would silently change the model."""
    size = tp_size()
    if total % size:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={size}")
    return total // size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results over ranks, in place; a no-op on one rank."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x
