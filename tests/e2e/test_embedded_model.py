"""The embedded default model, as `make model` leaves it: a SmolLM2-135M Llama with a ChatML template.

Stdlib only, so it runs even where torch is absent; skips when the model was never fetched.
"""
import glob
import json
import os

import pytest

from scheduler_svc.common.model_paths import default_model_dir

MODEL_DIR = default_model_dir()

needs_model = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MODEL_DIR, "config.json")),
    reason=f"no embedded model at {MODEL_DIR} (run `make model`)",
)


def test_model_dir_follows_nanoserve_model_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSERVE_MODEL_DIR", str(tmp_path / "m"))
    assert default_model_dir() == str(tmp_path / "m")


def test_model_dir_defaults_under_xdg_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOSERVE_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_dir() == str(tmp_path / "nanoserve" / "models" / "SmolLM2-135M-Instruct")


def load_json(name: str) -> dict:
    with open(os.path.join(MODEL_DIR, name)) as f:
        return json.load(f)


@needs_model
def test_config_describes_smollm2_135m_llama_shape():
    config = load_json("config.json")
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 576
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["vocab_size"] == 49152


@needs_model
def test_config_ties_embeddings_and_ends_on_im_end():
    config = load_json("config.json")
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 2


@needs_model
def test_rope_theta_lives_under_rope_parameters():
    assert load_json("config.json")["rope_parameters"]["rope_theta"] == 100000.0


@needs_model
def test_weights_are_one_fp32_safetensors_file_without_lm_head():
    files = glob.glob(os.path.join(MODEL_DIR, "*.safetensors"))
    assert len(files) == 1
    # ~135M fp32 parameters; the tied lm_head is not stored twice.
    assert 500e6 < os.path.getsize(files[0]) < 560e6


@needs_model
def test_tokenizer_knows_chatml_specials_at_their_ids():
    added = {t["content"]: t["id"] for t in load_json("tokenizer.json")["added_tokens"]}
    assert added["<|endoftext|>"] == 0
    assert added["<|im_start|>"] == 1
    assert added["<|im_end|>"] == 2


@needs_model
def test_chat_template_is_chatml_with_generation_prompt():
    path = os.path.join(MODEL_DIR, "chat_template.jinja")
    template = open(path).read() if os.path.isfile(path) else load_json("tokenizer_config.json")["chat_template"]
    assert "<|im_start|>" in template and "<|im_end|>" in template
    assert "add_generation_prompt" in template
