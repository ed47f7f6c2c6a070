"""The prompts as the engine runs them: on the model's device, rows repeated per beam or returned sample, with the
ids that end a row and the pad id resolved against the model's config.

They are prepared where they arrive (host tensors on the host: only the finished batch is copied to the device) and,
where every new shape is a graph compilation (``runtime.static_shapes``: Gaudi) and ``bucket_size`` > 0,
left-padded to a whole number of buckets, as optimum-habana pads them (its ``update_model_kwargs_for_bucketing``):
prompts of any length in one bucket run the graphs of that bucket. The added columns are masked, so the tokens are
the unpadded prompt's; generate() drops them from the result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from polyfuse.generation.kv_cache import bucketed
from polyfuse.generation.options import GenerationOptions
from polyfuse.generation.padding import to_left_padding


@dataclass
class Prompts:
    input_ids: torch.Tensor  # [rows, n] left-padded, rows b * copies + j as transformers expands them
    mask: torch.Tensor  # bool [rows, n]
    padded: bool  # some row has left padding (the prefill then needs the key mask)
    eos: list  # ids that end a row (EOS ids and stop token ids)
    pad_token_id: int
    max_new_tokens: int
    extra: int = 0  # left columns added to reach a whole bucket (dropped from the result)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n(self) -> int:
        return self.input_ids.shape[1]

    @property
    def total(self) -> int:
        return self.n + self.max_new_tokens

    @property
    def padding_mask(self):
        """The mask where some row is left-padded, else None."""
        return self.mask if self.padded else None

    def position_ids(self) -> torch.Tensor:
        """Each row's positions [rows, n], counted from its first real token (padding at 1, as transformers)."""
        return (self.mask.long().cumsum(-1) - 1).masked_fill(~self.mask, 1)


def prepare_prompts(model, input_ids, attention_mask: Optional[torch.Tensor], options: GenerationOptions,
                    static_buckets: bool = False) -> Prompts:  # fmt: skip
    """``static_buckets``: left-pad to whole buckets of ``options.bucket_size`` (see the module's docstring)."""
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch >= 1, length >= 1], got {tuple(input_ids.shape)}")
    cfg = model.config
    n = input_ids.shape[1]
    new_tokens = options.new_tokens(n, cfg.max_position_embeddings)
    if n + new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {n} tokens + {new_tokens} new tokens exceeds the model's "
            f"{cfg.max_position_embeddings} positions"
        )
    eos = options.eos_ids(cfg.eos_token_id)
    pad = options.pad_token_id
    if pad is None:
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        mask = attention_mask.to(input_ids.device).bool()
    input_ids, mask = to_left_padding(input_ids, mask)  # a right-padded batch generates as its left-padded twin
    extra = 0
    if static_buckets and options.bucket_size > 0:
        extra = bucketed(n, options.bucket_size, cfg.max_position_embeddings - new_tokens) - n
        if extra:
            input_ids = torch.nn.functional.pad(input_ids, (extra, 0), value=pad)
            mask = torch.nn.functional.pad(mask, (extra, 0), value=False)
    padded = bool(extra) or (attention_mask is not None and not bool(mask.all()))
    if options.copies > 1:
        input_ids = input_ids.repeat_interleave(options.copies, dim=0)
        mask = mask.repeat_interleave(options.copies, dim=0)
    device = model.device
    return Prompts(input_ids.to(device), mask.to(device), padded, eos, pad, new_tokens, extra)
