"""Whether a draft model can propose for a target (speculative method draft), read from the two checkpoints'
config.json and tokenizer.json before anything loads: the same vocabulary (its proposals are the target's token
ids), the same tokenizer, heads that shard at the target's tensor-parallel size, and room for the target's longest
sequence. Torch-free: the scheduler's start-up checks it too."""
from __future__ import annotations

import json
import os


def _read_json(model_dir: str, name: str, what: str) -> dict:
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path):
        raise ValueError(f"{what} {model_dir!r} has no {name}")
    with open(path) as f:
        return json.load(f)


def _text_config(raw: dict) -> dict:
    """A multimodal config keeps its language model's fields under text_config."""
    return raw.get("text_config", raw)


def _tokenizer_identity(tokenizer: dict) -> tuple:
    """What decides the token ids: the model's vocabulary and merges, and the added (special) tokens."""
    model = tokenizer.get("model", {})
    added = sorted((t.get("id"), t.get("content")) for t in tokenizer.get("added_tokens", []))
    return json.dumps(model.get("vocab"), sort_keys=True), json.dumps(model.get("merges")), tuple(added)


def check_draft_model(target_dir: str, draft_dir: str, tensor_parallel_size: int,
                      max_model_len: int | None = None) -> None:
    """Raises ValueError, naming the field, for a draft that cannot propose for the target."""
    if not os.path.isdir(draft_dir):
        raise ValueError(f"--draft-model {draft_dir!r} is not a directory")
    target = _text_config(_read_json(target_dir, "config.json", "the model"))
    draft = _text_config(_read_json(draft_dir, "config.json", "--draft-model"))
    if draft.get("vocab_size") != target.get("vocab_size"):
        raise ValueError(f"--draft-model vocab_size {draft.get('vocab_size')} differs from the target's "
                         f"{target.get('vocab_size')}: its proposals would not be the target's token ids")
    has = [os.path.isfile(os.path.join(d, "tokenizer.json")) for d in (target_dir, draft_dir)]
    if has[0] != has[1]:  # (a target without one serves token ids only: so must its draft)
        raise ValueError(f"--draft-model {'has no' if has[0] else 'has a'} tokenizer.json, the target "
                         f"{'has one' if has[0] else 'has none'}: they must share the tokenizer")
    if has[0] and _tokenizer_identity(_read_json(draft_dir, "tokenizer.json", "--draft-model")) != \
            _tokenizer_identity(_read_json(target_dir, "tokenizer.json", "the model")):
        raise ValueError("--draft-model tokenizer (tokenizer.json: vocab, merges or added_tokens) differs from the "
                         "target's: the same ids would be different text")
    heads = draft.get("num_attention_heads", 0)
    kv_heads = draft.get("num_key_value_heads") or heads
    for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                         ("intermediate_size", draft.get("intermediate_size", 0))):
        if value % tensor_parallel_size:
            raise ValueError(f"--draft-model {field}={value} is not divisible by --tensor-parallel-size "
                             f"{tensor_parallel_size}: it cannot shard beside the target")
    longest = min(max_model_len or target.get("max_position_embeddings", 0), target.get("max_position_embeddings", 0))
    if draft.get("max_position_embeddings", 0) < longest:
        raise ValueError(f"--draft-model max_position_embeddings {draft.get('max_position_embeddings')} is shorter "
                         f"than the target's longest sequence ({longest} tokens)")
