"""Where the embedded default model lives, and which files of a checkpoint hold its weights. Stdlib only: the CLI
imports this without torch."""
import json
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> str:
    """$NANOSERVE_MODEL_DIR, else ${XDG_CACHE_HOME:-~/.cache}/nanoserve/models/SmolLM2-135M-Instruct."""
    explicit = os.environ.get("NANOSERVE_MODEL_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(cache), "nanoserve", "models", DEFAULT_MODEL_NAME)


SAFETENSORS_INDEX = "model.safetensors.index.json"


def checkpoint_files(model_dir: str) -> list[str]:
    """The checkpoint's weight files, sorted: those its model.safetensors.index.json maps tensors to, where it has one
    (a repository may keep another copy of the weights beside them, as Mistral's consolidated.safetensors), else
    every *.safetensors file. FileNotFoundError names a file the index lists and the directory lacks."""
    index = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [name for name in names if not os.path.exists(os.path.join(model_dir, name))]
        if missing:
            raise FileNotFoundError(f"{model_dir}: {SAFETENSORS_INDEX} maps tensors to files that are not there: "
                                    f"{missing[:4]}")
    else:
        names = sorted(entry for entry in os.listdir(model_dir) if entry.endswith(".safetensors"))
    return [os.path.join(model_dir, name) for name in names]
