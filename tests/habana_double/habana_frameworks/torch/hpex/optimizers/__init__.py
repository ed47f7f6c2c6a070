"""TEST DOUBLE of ``habana_frameworks.torch.hpex.optimizers``: FusedAdamW is torch's AdamW math, recorded.

The constructor has the real signature (hpex/optimizers/FusedAdamW.py: ``params, lr=1e-3, betas=(0.9, 0.999),
eps=1e-6, weight_decay=0.0, bias_correction=True, moments_dtype=None``; no torch-only keywords such as ``amsgrad``
or ``fused``) and refuses a parameter group without parameters: optimum-habana's GaudiTrainer.create_optimizer
filters them out "because they make FusedAdamW crash".
"""

import torch

from habana_frameworks import on_hpu, record


class FusedAdamW(torch.optim.AdamW):
    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True, moments_dtype=None
    ):
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [dict(g, params=list(g["params"])) for g in params]
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        for i, group in enumerate(groups):
            if not group["params"]:
                raise RuntimeError(f"FusedAdamW (test double): parameter group {i} is empty (the real one crashes)")
        on_hpu("FusedAdamW", *[p for g in groups for p in g["params"]])
        record("FusedAdamW", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, groups=len(groups))
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
