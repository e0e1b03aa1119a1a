"""A draft model that cannot propose for the target is refused when the engine's config is built, naming the field:
another vocabulary size or tokenizer, heads that do not shard at the target's tensor-parallel size, too short a
context; --speculative-method draft and --draft-model come together."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from scheduler_svc.common.config import EngineConfig


def copy_config(src: str, dst: str, tokenizer: bool = True, **fields) -> str:
    """A checkpoint directory with src's config.json (fields changed) and tokenizer files; no weights (the check
    reads none)."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, **fields}, f)
    if tokenizer:
        shutil.copy(os.path.join(src, "tokenizer.json"), dst)
    return dst


def draft_config(model: str, draft: str, **overrides) -> EngineConfig:
    return EngineConfig(model=model, speculative_method="draft", draft_model=draft, **overrides)


def test_a_draft_of_the_same_vocabulary_and_tokenizer_is_accepted(embedded_model, tmp_path):
    draft = copy_config(embedded_model, str(tmp_path / "draft"), num_hidden_layers=2, hidden_size=64)
    assert draft_config(embedded_model, draft).draft_model == draft


def test_a_draft_of_another_vocabulary_size_is_refused(embedded_model, tmp_path):
    draft = copy_config(embedded_model, str(tmp_path / "draft"), vocab_size=32000)
    with pytest.raises(ValueError, match="vocab_size 32000 differs from the target's 49152"):
        draft_config(embedded_model, draft)


def test_a_draft_with_another_tokenizer_is_refused(embedded_model, tmp_path):
    draft = copy_config(embedded_model, str(tmp_path / "draft"))
    path = os.path.join(draft, "tokenizer.json")
    with open(path) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other text
    with open(path, "w") as f:
        json.dump(tokenizer, f)
    with pytest.raises(ValueError, match="tokenizer"):
        draft_config(embedded_model, draft)
    no_tokenizer = copy_config(embedded_model, str(tmp_path / "bare"), tokenizer=False)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        draft_config(embedded_model, no_tokenizer)


def test_a_draft_that_cannot_shard_at_the_target_tensor_parallel_size_is_refused(embedded_model, tmp_path):
    target = copy_config(embedded_model, str(tmp_path / "target"), num_attention_heads=8, num_key_value_heads=4)
    shutil.copy(os.path.join(embedded_model, "tokenizer.json"), target)
    draft = copy_config(embedded_model, str(tmp_path / "draft"), num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by --tensor-parallel-size 2"):
        draft_config(target, draft, tensor_parallel_size=2)
    assert draft_config(target, draft, tensor_parallel_size=3).tensor_parallel_size == 3


def test_a_draft_shorter_than_the_target_context_is_refused_unless_the_limit_fits(embedded_model, tmp_path):
    draft = copy_config(embedded_model, str(tmp_path / "draft"), max_position_embeddings=1024)
    with pytest.raises(ValueError, match="max_position_embeddings 1024 is shorter"):
        draft_config(embedded_model, draft)
    assert draft_config(embedded_model, draft, max_model_len=1024).max_model_len == 1024


def test_the_draft_method_and_the_draft_model_come_together(embedded_model):
    with pytest.raises(ValueError, match="--speculative-method draft needs --draft-model"):
        EngineConfig(model=embedded_model, speculative_method="draft")
    with pytest.raises(ValueError, match="--draft-model is only used with it"):
        EngineConfig(model=embedded_model, speculative_method="ngram", draft_model=embedded_model)
    with pytest.raises(ValueError, match="is not a directory"):
        draft_config(embedded_model, "/nonexistent/draft")
