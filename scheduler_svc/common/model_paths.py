"""Where the embedded default model lives. Stdlib only: the CLI imports this without torch."""
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> str:
    """$NANOSERVE_MODEL_DIR, else ${XDG_CACHE_HOME:-~/.cache}/nanoserve/models/SmolLM2-135M-Instruct."""
    explicit = os.environ.get("NANOSERVE_MODEL_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(cache), "nanoserve", "models", DEFAULT_MODEL_NAME)
