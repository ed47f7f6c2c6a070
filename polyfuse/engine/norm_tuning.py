"""Norm re-tuning after quantization: fit only the model's RMSNorm weights so that the quantized model's next-token
distributions come back toward the float model's on calibration text (KL divergence, float model as the target).

Quantizing the projections moves every layer's output a little; the norms scale each channel of the inputs those
projections see, so a few float vectors per layer (35,136 numbers on the built-in model, 0.03% of it; 266,240 on
Llama-3-8B) can undo part of the drift. The packed projections are frozen: the layout, kernels and checkpoints are
those of the quantization, and a save carries the tuned norms as the float weights they are. The idea is Norm Tweaking
(Li et al., 2023), which fits each layer's norm to its float output one layer at a time; this fits all of them at
once to the float model's next-token distributions, which measured better on the built-in model
(docs/quantization.md, "Quality").

Two steps around the quantization: ``norm_targets`` (the float model's final-norm outputs on the windows: [L, H]
each, not [L, vocab] logits; the target logits are remade by the LM head at each step, which quantize_model_ leaves
float) before it, ``tune_norms_`` after it. Each tuning step is one window: a forward and a backward through the
quantized model with the ops resolved for training (the quantized matmuls' references: dequantize, then matmul; the
gradient reaches the activations, not the packed weights) and every decoder layer recomputed in the backward, so one
layer's dequantized weights are held at a time, then one Adam step on the norms.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.nn.functional as F

from polyfuse.core.registry import resolve
from polyfuse.engine.qlinear import QLinear


logger = logging.getLogger("polyfuse")


# Adam's learning rate and its steps (one window each; the windows are visited in seeded passes, a new order each
# pass). On the built-in model's int4 (docs/quantization.md, "Norm tuning") more steps kept helping up to about 100
# with 26 windows of 512 tokens (1 pass: 26 steps) and with 3 windows (16 passes: 48 steps, not yet flat); the
# learning rate 5e-3 was worse than 2e-3 at every pass.
NORM_LR = 2e-3
NORM_STEPS = 128


def norm_weights(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, weight) of every RMSNorm: the layers' input / post-attention norms, the final norm, and a family's own
    (Qwen3's per-head q / k norms). Modules named ``*norm*`` with a ``weight`` and ``eps``: the decoder's RMSNorm."""
    found = []
    for name, module in model.named_modules():
        if (
            "norm" in name.rsplit(".", 1)[-1]
            and hasattr(module, "eps")
            and isinstance(module.weight, torch.nn.Parameter)
        ):
            found.append((name + ".weight", module.weight))
    return found


def _check(model, windows: list) -> None:
    if getattr(model, "vocab", None) is not None:
        raise ValueError("norm tuning runs on one device, not under tensor parallelism (tune and save_pretrained "
                         "on one device, then load that checkpoint sharded)")  # fmt: skip
    if not windows or any(w.numel() < 2 for w in windows):
        raise ValueError("norm tuning needs calibration windows of at least 2 tokens")
    if not norm_weights(model):
        raise ValueError(f"norm tuning: a {type(model).__name__} has no RMSNorm weights")


@torch.no_grad()
def norm_targets(model, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The float ``model``'s final-norm outputs [B, L, H] (its dtype and device) on each token window ([L] or
    [B, L]): what ``tune_norms_`` fits the quantized model's distributions to, through the LM head."""
    _check(model, windows)
    found = []
    handle = model.model.norm.register_forward_hook(lambda m, args, out: found.append(out.detach()))
    try:
        for ids in windows:
            ids = ids.to(model.device)
            model(ids[None] if ids.dim() == 1 else ids)
    finally:
        handle.remove()
    return found


def tune_norms_(model, windows: list[torch.Tensor], targets: list[torch.Tensor], steps: int = NORM_STEPS,
                lr: float = NORM_LR, seed: int = 0, log=None) -> dict:  # fmt: skip
    """Fit the quantized ``model``'s RMSNorm weights in place to ``targets`` (``norm_targets`` of the float model on
    the same ``windows``): ``steps`` Adam steps (``lr``), one window each, the windows visited in passes of a seeded
    order, minimizing the KL divergence of the quantized model's next-token distributions from the float model's. The
    LM head must still be float (the target logits are made by it; quantize the head after tuning). Every other
    parameter and the model's kernels, mode and flags are as before on return. ``log(pass, mean KL)`` after each pass
    (the last may be partial; the KL of its steps, measured as the weights moved). If the tuned norms give a higher
    KL over the windows than the untuned ones (the steps overshot: a quantization error that was small to begin
    with), the untuned norms are put back, with one warning. Returns the mean KL per token over the windows,
    {"before": ..., "after": ... (with the norms kept), "passes": [each pass's], "tuned": whether the tuned norms
    were kept}."""
    _check(model, windows)
    if len(targets) != len(windows):
        raise ValueError(f"tune_norms_: {len(targets)} targets for {len(windows)} windows")
    if isinstance(model.lm_head, QLinear):
        raise ValueError("norm tuning needs the float LM head (its targets are made by it): quantize the head after")
    if steps < 1 or not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"tune_norms_: steps >= 1 and a finite lr > 0, got {steps} and {lr}")
    params = [p for _, p in norm_weights(model)]
    tuned = {id(p) for p in params}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    saved = (model.kernels, model.training, model.gradient_checkpointing)
    generator = torch.Generator().manual_seed(seed)
    # float32 copies take Adam's steps (in bf16 a weight near 1 moves only by 2^-8 or more: each step of about lr
    # would round away); the model's weights are these, rounded to its dtype, after every step
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.Adam(masters, lr=lr)
    start = [p.detach().clone() for p in params]
    try:
        for p in model.parameters():
            p.requires_grad_(id(p) in tuned)
        model.kernels = resolve(dataclasses.replace(saved[0].context, training=True))  # quantized: the references
        model.train(True)
        model.gradient_checkpointing = True  # one layer's dequantized weights held at a time, not the model's
        before, passes = _mean_kl(model, windows, targets), []
        with torch.enable_grad():
            for first in range(0, steps, len(windows)):
                total = tokens = 0
                order = torch.randperm(len(windows), generator=generator).tolist()[: steps - first]
                for i in order:
                    loss, n = _kl(model, windows[i], targets[i])
                    for p in params:
                        p.grad = None
                    loss.backward()
                    for p, master in zip(params, masters):
                        master.grad = None if p.grad is None else p.grad.float()  # None: not used, not moved
                    optimizer.step()
                    with torch.no_grad():
                        for p, master in zip(params, masters):
                            p.copy_(master)
                    total, tokens = total + loss.item() * n, tokens + n
                passes.append(total / tokens)
                if log is not None:
                    log(len(passes), passes[-1])
        after = _mean_kl(model, windows, targets)
        if not after < before:  # the steps overshot (a small error to begin with: int8, fp8): undo them
            with torch.no_grad():
                for p, p0 in zip(params, start):
                    p.copy_(p0)
            logger.warning("warning: norm tuning: the KL to the float model on the calibration windows rose (%.5f "
                           "-> %.5f per token): the norms are kept as they were", before, after)  # fmt: skip
    finally:
        model.kernels, training, model.gradient_checkpointing = saved
        model.train(training)
        for name, p in model.named_parameters():
            p.requires_grad_(grads[name])
            p.grad = None
    return {"before": before, "after": min(before, after), "passes": passes, "tuned": after < before}


def _kl(model, ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The mean KL(float || quantized) per token of one window ([L] or [B, L]), and its token count."""
    ids = ids.to(model.device)
    ids = ids[None] if ids.dim() == 1 else ids
    logp = F.log_softmax(model(ids).logits.float(), dim=-1).flatten(0, -2)
    with torch.no_grad():  # the float model's logits: its final-norm output through the same (float) head
        ref = F.log_softmax(model.lm_head(target.to(model.dtype)).float(), dim=-1).flatten(0, -2)
    return F.kl_div(logp, ref, log_target=True, reduction="batchmean"), logp.shape[0]


@torch.no_grad()
def _mean_kl(model, windows: list, targets: list) -> float:
    total = tokens = 0
    for ids, target in zip(windows, targets):
        loss, n = _kl(model, ids, target)
        total, tokens = total + loss.item() * n, tokens + n
    return total / tokens


def tuned_norm_count(model) -> int:
    """How many numbers norm tuning fits in ``model`` (its RMSNorm weights)."""
    return sum(p.numel() for _, p in norm_weights(model))
