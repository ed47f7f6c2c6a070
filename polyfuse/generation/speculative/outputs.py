"""Each row's tokens as a speculative run emits them, several per step: EOS ids and stop strings end a row at the
token that completes them (later accepted tokens are dropped, pads follow, as in the per-token loop), the length
budget caps it, the repetition penalty's seen ids follow, and a streamer gets one position of every row at a time.
Tokens are kept on the host: the run reads each step's acceptance back anyway."""

from __future__ import annotations

import torch

from polyfuse.generation.logits_processors import mark_seen_, seen_mask


class RowOutputs:
    def __init__(self, d, vocab: int):
        p = d.prompts
        self.d, self.max_new, self.pad = d, p.max_new_tokens, p.pad_token_id
        self.eos = set(p.eos)
        self.tokens = [[] for _ in range(p.rows)]
        self.finished = [False] * p.rows
        self.streamed = 0
        # each row's real tokens (no left padding), for prompt lookup's n-gram matching
        self.prompt_rows = [ids[m].tolist() for ids, m in zip(p.input_ids.cpu(), p.mask.cpu())]
        self.seen = seen_mask(p.input_ids, vocab, mask=p.padding_mask) if d.options.penalty is not None else None

    def done(self, r: int) -> bool:
        return self.finished[r] or len(self.tokens[r]) >= self.max_new

    def all_done(self) -> bool:
        return all(self.done(r) for r in range(len(self.tokens)))

    def running(self) -> list:
        return [not self.done(r) for r in range(len(self.tokens))]

    def history(self, r: int) -> list:
        """Row r's real prompt tokens and every token emitted so far (the pending one last)."""
        return self.prompt_rows[r] + self.tokens[r]

    def _emit(self, r: int, tok: int) -> None:
        self.tokens[r].append(tok)
        if tok in self.eos:
            self.finished[r] = True
        elif self.d.stop is not None:
            p = self.d.prompts
            seq = torch.cat([p.input_ids[r].cpu(), torch.tensor(self.tokens[r], dtype=p.input_ids.dtype)])
            self.finished[r] = bool(self.d.stop(seq[None], p.n)[0])

    def add(self, accepted: list, emitted: list) -> int:
        """Row r emits ``emitted[r][: accepted[r] + 1]`` while it runs; returns how many tokens were kept."""
        kept = 0
        for r, (a, row) in enumerate(zip(accepted, emitted)):
            for tok in row[: a + 1]:
                if self.done(r):
                    break
                self._emit(r, tok)
                kept += 1
        self._stream()
        return kept

    def first(self, tokens: torch.Tensor) -> None:
        self.add([0] * len(self.tokens), [[t] for t in tokens.tolist()])

    def mark_seen(self, accepted: torch.Tensor, emitted: torch.Tensor) -> None:
        """The penalty's seen ids after a step (position 0 is always emitted: it stands in for the rest)."""
        if self.seen is None:
            return
        width = torch.arange(emitted.shape[1], device=emitted.device)
        for j in range(emitted.shape[1]):
            mark_seen_(self.seen, torch.where(width[j] <= accepted, emitted[:, j], emitted[:, 0]))

    def _stream(self) -> None:
        """Hand the streamer every position all rows have reached (a finished row's positions are pads)."""
        s = self.d.streamer
        if s is None:
            return
        while all(len(t) > self.streamed or self.done(r) for r, t in enumerate(self.tokens)):
            if all(len(t) <= self.streamed for t in self.tokens):
                break
            i = self.streamed
            s.put(torch.tensor([t[i] if len(t) > i else self.pad for t in self.tokens]))
            self.streamed += 1

    def result(self, dtype, device) -> torch.Tensor:
        """[rows, longest row] of new tokens, pads after a row's end."""
        n = max(len(t) for t in self.tokens)
        out = torch.full((len(self.tokens), n), self.pad, dtype=dtype)
        for r, t in enumerate(self.tokens):
            out[r, : len(t)] = torch.tensor(t, dtype=dtype)
        return out.to(device)
