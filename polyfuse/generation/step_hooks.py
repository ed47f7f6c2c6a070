"""What a generate() call adds to each step beyond the built-in settings, with transformers' semantics and objects:

* ``StepProcessors``: transformers' own logits processors for ``no_repeat_ngram_size``, ``bad_words_ids``,
  ``min_length`` and ``min_new_tokens`` (in transformers' order, after the repetition penalty), merged with the
  caller's ``logits_processor`` list as transformers merges it (a caller's processor replaces the built-in one of
  its type; the others follow), all before the sampling warpers;
* ``criteria``: the caller's ``stopping_criteria`` (a ``StoppingCriteriaList`` or a list of them), asked after every
  token as transformers asks them (a row they stop is padded afterwards, like one that emitted EOS);
* ``StepRecord``: the per-step ``scores`` (processed, warped when sampling) and raw ``logits`` that
  ``return_dict_in_generate`` returns with ``output_scores`` / ``output_logits``, and the output object.

Any of them makes greedy decoding run the per-token loop (generate.py says so in one log line).
"""

from __future__ import annotations

from typing import Optional

import torch


class StepProcessors:
    """``processors(input_ids [rows, L], scores [rows, V]) -> scores``: input_ids are every row's ids so far."""

    def __init__(self, processors: list):
        self.processors = processors

    @classmethod
    def build(cls, options, prompt_len: int, eos: list, device, custom=None) -> Optional["StepProcessors"]:
        from transformers.generation import logits_process as lp

        eos_ids = list(eos) if eos else None
        built = []
        if options.no_repeat_ngram_size:
            built.append(lp.NoRepeatNGramLogitsProcessor(options.no_repeat_ngram_size))
        if options.bad_words_ids:
            built.append(lp.NoBadWordsLogitsProcessor([list(w) for w in options.bad_words_ids], eos_ids))
        if eos_ids is not None and options.min_length > 0:
            built.append(lp.MinLengthLogitsProcessor(options.min_length, eos_ids, device=device))
        if eos_ids is not None and options.min_new_tokens:
            built.append(lp.MinNewTokensLengthLogitsProcessor(prompt_len, options.min_new_tokens, eos_ids, device))
        merged = _merge(built, list(custom or []))
        return cls(merged) if merged else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:
            scores = processor(input_ids, scores)
        return scores


def _merge(built: list, custom: list) -> list:
    """transformers' merge of its own processors with the caller's: a caller's one of the same type takes the
    built-in one's place, the caller's others come after."""
    out = [next((c for c in custom if type(c) is type(b)), b) for b in built]
    return out + [c for c in custom if c not in out]


def criteria_of(stopping_criteria):
    """The caller's stopping criteria as one callable ``(input_ids, scores) -> bool [rows]``, or None."""
    if stopping_criteria is None or len(stopping_criteria) == 0:
        return None
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    as_list = stopping_criteria if isinstance(stopping_criteria, StoppingCriteriaList) else None
    if as_list is None:
        as_list = StoppingCriteriaList(list(stopping_criteria))

    def stop(input_ids: torch.Tensor, scores) -> torch.Tensor:
        done = as_list(input_ids, scores)
        return torch.as_tensor(done, dtype=torch.bool, device=input_ids.device).expand(input_ids.shape[0])

    return stop


class StepRecord:
    """Per-step scores / logits kept for ``return_dict_in_generate`` (None where not asked)."""

    def __init__(self, options):
        keep = options.return_dict_in_generate
        self.scores = [] if keep and options.output_scores else None
        self.logits = [] if keep and options.output_logits else None

    def add(self, logits: torch.Tensor, scores: torch.Tensor) -> None:
        if self.logits is not None:
            self.logits.append(logits.float().clone())
        if self.scores is not None:
            self.scores.append(scores.clone())

    def scores_so_far(self):
        """What stopping criteria get as ``scores``: the tuple so far, as transformers passes it, or None."""
        return tuple(self.scores) if self.scores is not None else None

    def output(self, sequences: torch.Tensor, beams=None):
        """transformers' ``GenerateDecoderOnlyOutput`` (``GenerateBeamDecoderOnlyOutput`` for beam search:
        ``beams`` = (sequences_scores, beam_indices))."""
        from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

        scores = tuple(self.scores) if self.scores is not None else None
        logits = tuple(self.logits) if self.logits is not None else None
        if beams is None:
            return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)
        sequences_scores, beam_indices = beams
        return GenerateBeamDecoderOnlyOutput(
            sequences=sequences, sequences_scores=sequences_scores if scores is not None else None, scores=scores,
            logits=logits, beam_indices=beam_indices,
        )  # fmt: skip
