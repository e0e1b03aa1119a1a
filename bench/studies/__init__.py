"""One-off studies (README.md here). What the ones that check their kernels on the CPU share."""
import os


def triton_mode_from_argv(argv: list[str]) -> None:
    """--interpret-check: Triton's CPU interpreter; --compile-check: compiled code, even where the environment asks
    for the interpreter. Call before any kernel is decorated."""
    if "--interpret-check" in argv:
        os.environ["TRITON_INTERPRET"] = "1"
    elif "--compile-check" in argv:
        os.environ.pop("TRITON_INTERPRET", None)
