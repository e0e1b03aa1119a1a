"""Vocabulary-parallel token embedding and LM head: each rank owns a contiguous slice of the vocab.

The vocab is split into ceil(V / tp) rows per rank; the last shard is zero-padded when V does not
divide evenly, and the padding is cut off the gathered logits.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from executor_svc.layers.parallel import all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp_size())
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = loaded[self.vocab_start : self.vocab_start + self.rows_per_rank]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        mine = (local_ids >= 0) & (local_ids < self.rows_per_rank)
        out = F.embedding(torch.where(mine, local_ids, 0), self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0)  # rows owned by other ranks arrive in the sum
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden @ W_vocab^T; with tied embeddings the model shares embed_tokens' weight with it."""

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, vocab] on rank 0; None on the other ranks. `out` (one rank only) receives them."""
        if out is not None:
            assert tp_size() == 1, "logits into a given buffer need the whole vocab on this rank"
            return torch.mm(hidden, self.weight.t(), out=out)
        logits = F.linear(hidden, self.weight)
        if tp_size() > 1:
            parts = [torch.empty_like(logits) for _ in range(tp_size())] if tp_rank() == 0 else None
            dist.gather(logits, parts, dst=0)
            if tp_rank() != 0:
                return None
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.num_embeddings]
