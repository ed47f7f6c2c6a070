"""Speculative decoding in the shared generation engine, for every model family: a proposer drafts k tokens, the
target verifies them in one cached step over k + 1 positions, and the standard rule accepts a prefix of them (exact
greedy match at temperature 0; Leviathan et al. / Chen et al.'s rejection sampling when sampling, so the output
distribution is the target's). Rejected positions of the static KV cache are overwritten later, never copied.

settings.py (which method, which k) · plan.py (the proposer for a generate() call) · proposer.py (the interface) ·
prompt_lookup.py, draft_model.py, eagle3.py (the proposers) · verify.py (the k + 1 position step) · accept.py (the
acceptance rules) · slots.py (cache slots, key mask, compaction) · outputs.py (per-row tokens, EOS, stop strings,
streaming) · stats.py · loop.py (the run). docs/speculative.md is the reference.

Nothing is imported here, so that generation/options.py and the engine's modules can import the files they need
without a cycle through this package.
"""
