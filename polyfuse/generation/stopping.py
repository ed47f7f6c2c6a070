"""Stop conditions besides EOS ids: ``stop_strings``, per row, with transformers' semantics.

With a tokenizer (anything with ``get_vocab()``, as transformers' tokenizers have), the check is transformers'
``StopStringCriteria`` itself, run on the same sequences (prompt, left padding included, + generated tokens): a row
stops at the token that completes a stop string, including one that overhangs the string's end ("st" + "opped"
stops on "stop"), never on a string that ended before the last token. With a plain callable ``decode(ids) -> str``
instead, the same rule is applied to the row's decoded new text: the row stops when a stop string occurs in it and
ends inside the last token's text (``decode(new)`` is assumed to extend ``decode(new[:-1])``).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch


def as_stop_strings(stop_strings: Union[str, Sequence[str], None]) -> tuple[str, ...]:
    """() for None; a ValueError naming the problem for anything but non-empty strings."""
    if stop_strings is None:
        return ()
    strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop_strings must be non-empty strings, got {s!r}")
    return strings


class StopStrings:
    """``stop(sequences [rows, L], prompt_len) -> bool [rows]`` on the sequences' device: True where the row's last
    token completes one of ``stop_strings``."""

    def __init__(self, stop_strings: Sequence[str], tokenizer: Union[object, Callable[[list], str], None]):
        self.strings = as_stop_strings(stop_strings)
        self.criteria = None
        self.decode = None
        if tokenizer is None:
            raise ValueError(
                "stop_strings needs tokenizer= (a tokenizer, or a callable decoding a list of token ids to text)"
            )
        if hasattr(tokenizer, "get_vocab"):
            from transformers.generation.stopping_criteria import StopStringCriteria

            self.criteria = StopStringCriteria(tokenizer, list(self.strings))
        elif callable(tokenizer):
            self.decode = tokenizer
        else:
            raise ValueError(
                f"tokenizer must be a tokenizer or a callable decoding token ids to text, got {type(tokenizer).__name__}"
            )

    def __call__(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        if self.criteria is not None:
            return self.criteria(sequences, None).to(torch.bool)
        hits = []
        for row in sequences[:, prompt_len:].tolist():
            text = self.decode(row)
            prev = len(self.decode(row[:-1])) if len(row) > 1 else 0
            hits.append(any(text.find(s, max(0, prev - len(s) + 1)) >= 0 for s in self.strings))
        return torch.tensor(hits, dtype=torch.bool, device=sequences.device)
