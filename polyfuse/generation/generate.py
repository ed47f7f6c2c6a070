"""``generate(model, input_ids, attention_mask=None, **kwargs)``: the entry, with transformers' ``generate``
semantics; it picks the strategy and the feed, each in its own module:

* prompt step (prefill.py), then one of: greedy in place (greedy.py: the graphed ``TokenStep``, one call per
  token), the per-token loop (token_loop.py: sampling, stop strings, runtimes without in-place decoding such as
  HPU) or beam search (beam_search.py), fed by the decode step over the KV cache (feeds.py);
* ``use_cache=False``: the per-token loop or beam search fed by the cache-less forward (the baseline).

Where every new shape is a graph compilation (``runtime.static_shapes``: Gaudi) and ``bucket_size`` > 0, the prompts
run left-padded to whole buckets (prompts.py); prompts given on the host are prepared there and their result comes
back there, the padding dropped on the host, so that only bucket shapes reach the device (the CLI's
--reduce_recompile).

Every step runs through the device runtime (``runtime.graph_module``, steps.py), so CUDA or HPU graphs replace it
when the run asks for them; everything here is device-agnostic. The settings are :class:`GenerationOptions`.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from polyfuse.generation.beam_search import beam_search
from polyfuse.generation.decoding import Decoding
from polyfuse.generation.feeds import CachedFeed, FullForwardFeed, StaticFullForwardFeed
from polyfuse.generation.greedy import greedy_in_place
from polyfuse.generation.hf_config import model_generation_config
from polyfuse.generation.options import GenerationOptions, check_generation_options, check_runtime_objects
from polyfuse.generation.prefill import prefill, prompt_key_mask
from polyfuse.generation.prompts import prepare_prompts
from polyfuse.generation.speculative.loop import speculative_decode
from polyfuse.generation.speculative.plan import make_proposer, plan_speculation
from polyfuse.generation.step_hooks import StepProcessors, StepRecord, criteria_of
from polyfuse.generation.steps import prepare_cache
from polyfuse.generation.stopping import StopStrings
from polyfuse.generation.token_loop import token_loop
from polyfuse.generation.token_state import TokenState


__all__ = ["generate", "check_generation_options"]  # the latter: the CLI's check of its flags

logger = logging.getLogger("polyfuse")
_told: set = set()  # the per-token-loop reasons already logged (once each per process)


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """Return prompt + new ids [rows, L + n]. Rows that reached EOS are filled with ``pad_token_id`` afterwards and
    generation stops once every row is done (unless ``ignore_eos``). Prompts are left-padded (``attention_mask``).

    ``kwargs``: the settings of :class:`GenerationOptions` (transformers' names: ``max_new_tokens``,
    ``max_length``, ``min_length``, ``min_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``, ``num_beams``, ``num_return_sequences``,
    ``length_penalty``, ``early_stopping``, ``stop_strings``, ``eos_token_id``, ``pad_token_id``, ``use_cache``,
    ``return_dict_in_generate``, ``output_scores``, ``output_logits``; polyfuse's ``ignore_eos``,
    ``stop_token_ids``, ``bucket_size``), ``generation_config`` (a transformers ``GenerationConfig``: the keywords
    over it, it over the model's ``generation_config``, as transformers), and the call's objects:

    * ``generator``: the sampling ``torch.Generator``;
    * ``tokenizer``: a tokenizer, or a callable decoding a list of ids to text (needed by ``stop_strings``: a row
      stops at the token completing one, as transformers' StopStringCriteria);
    * ``streamer``: ``put(ids)`` / ``end()`` (transformers' BaseStreamer): the prompt, then each position's tokens
      [rows], then end(); not with beam search. Greedy in place then reads each token back (a sync per token);
    * ``hooks``: a :class:`polyfuse.generation.hooks.GenerationHooks` told the phase boundaries (timing);
    * ``logits_processor`` / ``stopping_criteria``: transformers' lists, applied as transformers does (step_hooks.py);
    * speculative decoding (generation/speculative, docs/speculative.md): ``prompt_lookup_num_tokens`` (with
      ``max_matching_ngram_size``), ``assistant_model`` (a loaded draft model of the same tokenizer, with
      ``num_assistant_tokens``) or ``speculative_model`` (loaded EAGLE-3 heads; ``speculative_method="draft"``: a
      draft model), ``num_speculative_tokens`` (k). Greedy output is token for token the same; sampled output has
      the same distribution. With beam search or ``use_cache=False`` one warning, and no speculation.

    With ``return_dict_in_generate`` the result is transformers' ``GenerateDecoderOnlyOutput`` (beam search:
    ``GenerateBeamDecoderOnlyOutput``) with ``sequences`` and, where asked, ``scores`` / ``logits``.

    Beams and returned sequences are rows ``b * k + j``. Greedy decoding keeps the in-place TokenStep (and its CUDA
    graph) with ``repetition_penalty`` and ``stop_token_ids``; beam search and stop strings run the per-token step.
    """
    names = (
        "generator",
        "tokenizer",
        "streamer",
        "hooks",
        "logits_processor",
        "stopping_criteria",
        "assistant_model",
        "speculative_model",
    )
    objects = {name: kwargs.pop(name, None) for name in names}
    options = GenerationOptions.from_kwargs(model_config=model_generation_config(model), **kwargs)
    check_runtime_objects(options, objects["tokenizer"], objects["streamer"])
    drafts = objects["assistant_model"], objects["speculative_model"]
    speculation = plan_speculation(options, *drafts)
    if speculation is not None and (objects["logits_processor"] or objects["stopping_criteria"] or options.outputs):
        raise ValueError("speculative decoding takes no logits_processor, stopping_criteria, output_scores or "
                         "output_logits: drop them or the speculative arguments")  # fmt: skip
    static = speculation is None and getattr(model.runtime, "static_shapes", False)  # prompts in whole buckets
    prompts = prepare_prompts(model, input_ids, attention_mask, options, static_buckets=static)
    stop = StopStrings(options.stop_strings, objects["tokenizer"]) if options.stop_strings else None
    d = Decoding(model, prompts, options, objects["generator"], stop, objects["streamer"], objects["hooks"])
    proposer = make_proposer(speculation, model, prompts.eos, *drafts) if speculation is not None else None
    d.processors = StepProcessors.build(
        options, prompts.n, prompts.eos, prompts.input_ids.device, objects["logits_processor"]
    )
    d.criteria = criteria_of(objects["stopping_criteria"])
    d.record = StepRecord(options) if options.return_dict_in_generate else None
    if d.streamer is not None:
        d.streamer.put(prompts.input_ids[:, prompts.extra :].cpu())
    if proposer is not None:
        result = speculative_decode(d, proposer)
    else:
        result = decode_cached(d) if options.use_cache else decode_without_cache(d)
    new_tokens = result.shape[1] - prompts.n
    result = without_bucket_padding(result, prompts, input_ids.device, model.device)
    if d.hooks is not None:
        d.hooks.end(new_tokens)
    if d.streamer is not None:
        d.streamer.end()
    if d.record is not None:
        return d.record.output(result, d.beam_outputs)
    return result


def without_bucket_padding(result, prompts, given_on, device) -> torch.Tensor:
    """``result`` without the columns a static-shape run added to reach a whole bucket, dropped on the host when
    the prompts came from there (no graph of the unpadded width on the device)."""
    if not prompts.extra:
        return result
    host = given_on.type == "cpu" and device.type != "cpu"
    return (result.cpu() if host else result)[:, prompts.extra :]


def per_token_reasons(d: Decoding) -> list:
    """Why greedy decoding cannot run the in-place TokenStep (argmax, repetition penalty and EOS ids only)."""
    o, reasons = d.options, list(d.options.processors_needed(d.prompts.n))
    if d.processors is not None and len(d.processors.processors) > len(reasons):
        reasons.append("logits_processor")
    if d.criteria is not None:
        reasons.append("stopping_criteria")
    if o.outputs:
        reasons.append("output_scores" if o.output_scores else "output_logits")
    return reasons


def decode_cached(d: Decoding) -> torch.Tensor:
    """The prompt step into the KV cache, then the strategy the settings and the runtime allow."""
    model, p, options = d.model, d.prompts, d.options
    steps = prepare_cache(model, p.rows, p.total, options.bucket_size)
    in_place = steps.token is not None and options.greedy
    if in_place and (reasons := per_token_reasons(d)):
        in_place = False
        if tuple(reasons) not in _told:
            _told.add(tuple(reasons))
            logger.info("polyfuse generate: greedy decoding runs the per-token loop for %s", ", ".join(reasons))
    state = TokenState.of(model.cache) if in_place else None
    if in_place:
        key_mask = state.key_mask  # a graph buffer of the token step
    else:
        key_mask = torch.empty(p.rows, model.cache.max_len, dtype=torch.bool, device=p.input_ids.device)
    key_mask = prompt_key_mask(p, key_mask)
    position_ids = p.position_ids()
    d.start()
    logits = prefill(steps.prefill, p, position_ids, key_mask)
    if in_place:
        return greedy_in_place(d, steps.token, state, logits, position_ids[:, -1:] + 1)
    feed = CachedFeed(model, steps.decode, key_mask, position_ids, options.bucket_size)
    if options.num_beams > 1:
        return beam_search(d, logits, feed.beams)
    return token_loop(d, logits, feed)


def decode_without_cache(d: Decoding) -> torch.Tensor:
    """Every token from a forward of the whole sequence so far (of prompt + max_new_tokens positions, the future
    masked, where the runtime compiles per shape)."""
    p = d.prompts
    if getattr(d.model.runtime, "static_shapes", False):
        feed = StaticFullForwardFeed(d.model, p.input_ids, p.mask, p.max_new_tokens, p.pad_token_id)
    else:
        feed = FullForwardFeed(d.model, p.input_ids, p.mask)
    d.start()
    logits = feed.logits()
    if d.options.num_beams > 1:
        return beam_search(d, logits, feed.beams)
    return token_loop(d, logits, feed)
