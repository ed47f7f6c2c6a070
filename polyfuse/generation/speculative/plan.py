"""The proposer of one generate() call, from its settings (settings.py) and the models it was given, or None where
no speculation was asked or it cannot apply (then one warning names what runs instead)."""

from __future__ import annotations

import logging
from typing import Optional

from polyfuse.generation.speculative.draft_model import DraftModel
from polyfuse.generation.speculative.eagle3 import Eagle3
from polyfuse.generation.speculative.prompt_lookup import PromptLookup
from polyfuse.generation.speculative.proposer import Proposer
from polyfuse.generation.speculative.settings import SpeculativeSetting, fallback, speculative_setting


logger = logging.getLogger("polyfuse")


def plan_speculation(options, assistant_model=None, speculative_model=None) -> Optional[SpeculativeSetting]:
    """The setting to run, None without speculation (with one warning where it was asked but cannot apply)."""
    setting = speculative_setting(options, assistant_model, speculative_model)
    if setting is None:
        return None
    if isinstance(speculative_model, str) or isinstance(assistant_model, str):
        raise ValueError(
            "generate() takes loaded draft models: load EAGLE-3 heads with polyfuse.models.load_eagle3 and a draft "
            "model with from_pretrained (model.generate(..., speculative_model=PATH) loads a path itself)"
        )
    why = fallback(options)
    if why is not None:
        logger.warning("warning: %s (speculative decoding: %s)", why, setting.method)
        return None
    return setting


def make_proposer(setting: SpeculativeSetting, model, eos, assistant_model=None, speculative_model=None) -> Proposer:
    """The proposer for ``setting`` on ``model``; ValueErrors for draft models that cannot draft for it."""
    if setting.method == "prompt_lookup":
        return PromptLookup(setting.k, setting.ngram, eos)
    draft = assistant_model if assistant_model is not None else speculative_model
    if setting.method == "draft":
        return DraftModel(draft, model, setting.k)
    return Eagle3(speculative_model, model, setting.k)
