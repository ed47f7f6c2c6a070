"""What a speculative run reports (the CLI's Stats block, benchmarks): acceptance rate and tokens per verify step."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SpeculationStats:
    method: str
    k: int
    steps: int = 0  # verify steps
    row_steps: int = 0  # verify steps x running rows
    drafted: int = 0  # tokens proposed to running rows
    accepted: int = 0  # of those, accepted by the target
    emitted: int = 0  # tokens the verify steps added (accepted drafts + the target's own next token, within budget)
    compactions: int = 0  # cache compactions (batch > 1: slots.py)

    def add(self, running: list, accepted: list, width: int, emitted: int) -> None:
        self.steps += 1
        for run, a in zip(running, accepted):
            if run:
                self.row_steps += 1
                self.drafted += width - 1
                self.accepted += a
        self.emitted += emitted

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row gains per verify step: its accepted drafts + 1 (EAGLE's acceptance length)."""
        return self.emitted / self.row_steps if self.row_steps else 0.0

    def as_dict(self) -> dict:
        return dict(asdict(self), acceptance_rate=self.acceptance_rate, tokens_per_step=self.tokens_per_step)
