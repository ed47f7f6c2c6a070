"""Incremental detokenization and stop strings.

Text grows as tokens arrive without decoding the whole output each time: the ids from ``prefix_offset`` are decoded
and compared with the decoding of those up to ``read_offset``; what the longer one adds is new text, unless it ends
in an incomplete UTF-8 character (U+FFFD), which waits for the next token. Only generated ids are decoded, with
special tokens skipped, so the text equals ``tokenizer.decode(output, skip_special_tokens=True)`` (what
run_generation.py prints with --print_new_text_only).

Stop strings (OpenAI's ``stop``) end the text where the first one begins, the string itself left out. While a
sequence runs, the last ``len(longest stop) - 1`` characters are held back from what is handed out (they may be the
start of a stop string), so the streamed pieces always concatenate to the final text.
"""

from __future__ import annotations

from polyfuse.serving.request import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, seq: Sequence) -> str:
        """Extend ``seq.text`` by its last output token; returns the new text (possibly empty)."""
        ids = seq.output
        prefix = self.decode(ids[seq.prefix_offset : seq.read_offset])
        full = self.decode(ids[seq.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        seq.text += new
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return new

    def token_text(self, token: int) -> str:
        """One token's own text, for log-probabilities (may be a partial character: then as the tokenizer says)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)


def find_stop(seq: Sequence, new_chars: int) -> bool:
    """Cut ``seq.text`` at the first stop string that the last ``new_chars`` characters complete; True if one did."""
    stops = seq.params.stop
    if not stops or not new_chars:
        return False
    longest = max(len(s) for s in stops)
    start = max(0, len(seq.text) - new_chars - longest + 1)
    hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
    if not hits:
        return False
    seq.text = seq.text[: min(hits)]
    return True


def ready_text(seq: Sequence) -> str:
    """The text not yet handed out that can be: all of it once the sequence finished, else all but the tail a stop
    string might still begin in. Marks it handed out."""
    end = len(seq.text)
    if not seq.finished and seq.params.stop:
        end = max(seq.sent, end - (max(len(s) for s in seq.params.stop) - 1))
    piece = seq.text[seq.sent : end]
    seq.sent = end
    return piece
