"""tqdm bars on stderr for the CLI's long work: loading big checkpoints, generating many tokens, GPTQ calibration and
tuning. The caller decides whether bars are on (stderr is a terminal and no --quiet); off, every helper here gives
nothing to call and draws nothing. Without tqdm installed there are no bars."""

from __future__ import annotations

import sys
import threading


# A generation bar shows for runs of at least this many new tokens (shorter ones finish before a bar says anything).
GENERATION_BAR_MIN_TOKENS = 256


def _tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


def counter(enabled: bool, desc: str, unit: str):
    """``progress(done, total)`` drawing a bar of ``total`` ``unit`` that shows ``done`` (absolute, not an
    increment), or None when bars are off; ``progress.close()`` ends it. Safe from several threads."""
    tqdm = _tqdm() if enabled else None
    if tqdm is None:
        return None
    state = {"bar": None}
    lock = threading.Lock()

    def progress(done: int, total: int) -> None:
        with lock:
            if state["bar"] is None:
                state["bar"] = tqdm(
                    total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, mininterval=0, miniters=1
                )  # fmt: skip  (few updates: each one drawn)
            bar = state["bar"]
            bar.update(done - bar.n)

    def close() -> None:
        with lock:
            if state["bar"] is not None:
                state["bar"].close()
                state["bar"] = None

    progress.close = close
    return progress


class TokenBar:
    """A generate() streamer drawing one bar per generate call: ``put`` gets the prompt first, then one position's
    tokens per call; ``end`` closes the bar. It makes the in-place greedy loop read each token back (one sync per
    token), which is why it is used only for long runs and --quiet turns it off."""

    def __init__(self, total: int, desc: str = "Generating"):
        self.total, self.desc, self.bar, self.prompt_seen = total, desc, None, False

    def put(self, ids) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            self.bar = _tqdm()(total=self.total, desc=self.desc, unit="tok", file=sys.stderr, leave=False,
                               mininterval=0.2)  # fmt: skip
            return
        self.bar.update(1)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.prompt_seen = None, False


def token_bar(enabled: bool, max_new_tokens: int):
    """A TokenBar for a run of ``max_new_tokens``, or None (bars off, tqdm missing, or a short run)."""
    if not enabled or max_new_tokens < GENERATION_BAR_MIN_TOKENS or _tqdm() is None:
        return None
    return TokenBar(max_new_tokens)
