"""TEST DOUBLE of ``habana_frameworks.torch.hpex.optimizers``: FusedAdamW is torch's AdamW, recorded."""

import torch

from habana_frameworks import record


class FusedAdamW(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, **kwargs):
        record("FusedAdamW", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
