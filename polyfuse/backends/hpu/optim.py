"""Habana's fused optimizer pieces, for the trainer; each helper returns None when they are unavailable.

* ``fused_adamw(params, **kw)`` -> ``habana_frameworks.torch.hpex.optimizers.FusedAdamW(params, **kw)``
  (GaudiConfig ``use_fused_adam``; Habana's default eps is 1e-6, which GaudiTrainingArguments mirrors). Parameter
  groups without parameters (everything frozen in a group: LoRA, frozen norms) are dropped first, as
  optimum-habana's GaudiTrainer.create_optimizer does: they crash FusedAdamW. No group left: None.
* ``fused_clip_norm(params, max_norm)`` -> ``habana_frameworks.torch.hpex.normalization.FusedClipNorm(params,
  max_norm)`` (GaudiConfig ``use_fused_clip_norm``). Use it as optimum-habana's GaudiTrainer does: build it once,
  then call ``clipper.clip_norm(model.parameters())`` after backward; it clips in place and returns the total norm.
"""

from __future__ import annotations

from polyfuse.backends.hpu import _habana


def drop_empty_groups(params) -> list:
    """``params`` as a list; for parameter groups (dicts), only those with at least one parameter."""
    params = list(params)
    if params and isinstance(params[0], dict):
        params = [dict(g, params=list(g["params"])) for g in params]
        params = [g for g in params if g["params"]]
    return params


def fused_adamw(params, **kw):
    cls = _habana.import_component(_habana.OPTIMIZERS, "FusedAdamW")
    if cls is None:
        return None
    params = drop_empty_groups(params)
    if not params:
        return None
    return cls(params, **kw)


def fused_clip_norm(params, max_norm: float):
    cls = _habana.import_component(_habana.NORMALIZATION, "FusedClipNorm")
    if cls is None:
        return None
    return cls(params, max_norm)
