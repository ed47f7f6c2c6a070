"""A GaudiConfig-compatible settings file (``gaudi_config.json``), read without optimum-habana installed: a file, a
folder holding one, or a Hub name (``Habana/llama``) found in the local Hugging Face cache (never downloaded)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Optional


GAUDI_CONFIG_NAME = "gaudi_config.json"


@dataclass
class GaudiConfig:
    use_torch_autocast: bool = False
    autocast_bf16_ops: Optional[list] = None
    autocast_fp32_ops: Optional[list] = None
    use_dynamic_shapes: bool = False
    use_fused_adam: bool = False
    use_fused_clip_norm: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> "GaudiConfig":
        known = {f.name for f in fields(cls)}
        # optimum-habana files may carry more keys (e.g. "optimum_version"); they are ignored like theirs.
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, cache_dir: Optional[str] = None, revision: str = "main"
    ) -> "GaudiConfig":
        """A JSON file, a folder holding ``gaudi_config.json``, or a Hub repository's ``gaudi_config.json`` already in
        the Hugging Face cache (``cache_dir``, else huggingface_hub's: ``HF_HUB_CACHE``)."""
        path = name_or_path
        if os.path.isdir(path):
            path = os.path.join(path, GAUDI_CONFIG_NAME)
        if not os.path.isfile(path):
            path = _from_hub_cache(name_or_path, cache_dir, revision)
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--gaudi_config_name {name_or_path!r}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--gaudi_config_name {name_or_path!r}: expected a JSON object")
        return cls.from_dict(data)

    def save_pretrained(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, GAUDI_CONFIG_NAME), "w") as f:
            json.dump(asdict(self), f, indent=2)


def _from_hub_cache(repo_id: str, cache_dir: Optional[str], revision: str) -> str:
    """The cached file's path (huggingface_hub's own lookup, no network), or one ValueError line saying how to get it."""
    found = None
    if repo_id.count("/") == 1 and not repo_id.endswith(".json"):
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(repo_id, GAUDI_CONFIG_NAME, cache_dir=cache_dir, revision=revision)
        except ValueError:  # not a valid repository id
            found = None
    if isinstance(found, str) and os.path.isfile(found):
        return found
    raise ValueError(
        f"--gaudi_config_name {repo_id!r}: no such file, and no {GAUDI_CONFIG_NAME} of a Hub repository {repo_id!r} in "
        f"the local Hugging Face cache (polyfuse does not download): fetch it once with `hf download {repo_id} "
        f"{GAUDI_CONFIG_NAME}` (huggingface_hub), or give a {GAUDI_CONFIG_NAME} path"
    )
