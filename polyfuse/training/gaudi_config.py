"""A GaudiConfig-compatible settings file (``gaudi_config.json``), read without optimum-habana installed."""

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
    def from_pretrained(cls, name_or_path: str) -> "GaudiConfig":
        """A JSON file, or a folder holding ``gaudi_config.json``. Hub names are not fetched (offline library)."""
        path = name_or_path
        if os.path.isdir(path):
            path = os.path.join(path, GAUDI_CONFIG_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"--gaudi_config_name {name_or_path!r}: no such file (give a gaudi_config.json path)")
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
