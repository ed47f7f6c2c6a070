"""Norm (and scale) re-tuning after quantization: fit only the model's RMSNorm weights (and / or the quantized
projections' float scales, below) so that the quantized model's next-token distributions come back toward the float
model's on calibration text (KL divergence, float model as the target).

Quantizing the projections moves every layer's output a little; the norms scale each channel of the inputs those
projections see, so a few float vectors per layer (35,136 numbers on the built-in model, 0.03% of it; 266,240 on
Llama-3-8B) can undo part of the drift. The packed projections are frozen: the layout, kernels and checkpoints are
those of the quantization, and a save carries the tuned norms as the float weights they are. The idea is Norm Tweaking
(Li et al., 2023), which fits each layer's norm to its float output one layer at a time; this fits all of them at
once to the float model's next-token distributions (the per-layer form has not been tried here).

Two steps around the quantization: ``norm_targets`` (the float model's final-norm outputs on the windows: [L, H]
each, not [L, vocab] logits; the target logits are remade by the LM head at each step, which quantize_model_ leaves
float) before it, ``tune_norms_`` after it. Each tuning step is one window: a forward and a backward through the
quantized model with the ops resolved for training (the quantized matmuls' references: dequantize, then matmul, with
float activations; the gradient reaches the activations, not the packed weights) and every decoder layer recomputed
in the backward, so one layer's dequantized weights are held at a time, then one Adam step on the norms. What is
fitted is therefore the weight-only model: where the run also rounds activations (fp8's W8A8 prefill on the GPU, int4's
opt-in int8 activations, a GGUF's one-row decode) the KL reported is not that of the kernels that serve.

Scale tuning (``scales=True``; alone or with the norms) moves the quantized projections' float scales the same way:
each scale becomes its stored value times (1 + r), r fitted by Adam (a relative step: the scales span orders of
magnitude), the integer codes and zero points as packed, the result rounded to the stored dtype (int4's float16) with
the gradient passed straight through that rounding. That is the end-to-end step of EfficientQAT (Chen et al., 2024),
which trains only the step sizes of a quantized model. The formats with float scales take part: int8, fp8, fp8_block
and int4, not a GGUF's (its scales live inside its blocks). On the built-in model's int4 (128 steps, float32, on an
H200) it took the held-out answers from +37.4% to +14.0% and the Declaration from +62.5% to +15.9% (the norms alone:
+22.4% and +29.4%; docs/quantization.md, "Quality"): with 26 times the numbers of the norms (0.90 M of 135 M
here), still 0.7% of the model.

With two windows or more, every eighth (at least one) is held out of the steps: the norms kept are those of the pass
with the lowest KL on the held-out windows, or the untuned ones if no pass lowered it (tuning that fits the
calibration windows but not others is not kept). With one window that window decides. The file keeps its name
(norm tuning came first); ``tune_norms_`` does both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import torch
import torch.nn.functional as F

from polyfuse.core.registry import resolve
from polyfuse.quant.qlinear import QLinear


logger = logging.getLogger("polyfuse")


# Adam's learning rate and steps (one window each, in passes of a seeded order): on the built-in model's int4, 52-128
# steps ended within each other's noise and 5e-3 did worse than 2e-3 (docs/quantization.md, "Quality").
NORM_LR = 2e-3
NORM_STEPS = 128
# Every HOLD_OUT-th window (at least one, with two windows or more) only judges the passes.
HOLD_OUT = 8
# Scale tuning: Adam's learning rate for each scale's relative change (scale = stored * (1 + ratio)); measured on the
# built-in model's int4 (docs/quantization.md, "Quality").
SCALE_LR = 1e-3
SCALED_FORMATS = ("int8", "fp8", "fp8_block", "int4")


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
        raise ValueError("tuning runs on one device, not under tensor parallelism (tune and save_pretrained "
                         "on one device, then load that checkpoint sharded)")  # fmt: skip
    if not windows or any(w.numel() < 2 for w in windows):
        raise ValueError("tuning needs calibration windows of at least 2 tokens")
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


def split_windows(n: int) -> tuple[list[int], list[int]]:
    """(indices the steps use, held-out indices) of ``n`` windows: every HOLD_OUT-th held out (the last one when
    there are fewer), none with one window."""
    held = list(range(HOLD_OUT - 1, n, HOLD_OUT)) or ([n - 1] if n > 1 else [])
    return [i for i in range(n) if i not in held], held


def _check_tuning(model, windows, targets, steps: int, lr: float, scale_lr: float, norms: bool, scales: bool):
    _check(model, windows)
    if len(targets) != len(windows):
        raise ValueError(f"tune_norms_: {len(targets)} targets for {len(windows)} windows")
    if isinstance(model.lm_head, QLinear):
        raise ValueError("tuning needs the float LM head (its targets are made by it): quantize the head after")
    if steps < 1 or not (lr > 0 and math.isfinite(lr)) or not (scale_lr > 0 and math.isfinite(scale_lr)):
        raise ValueError(f"tune_norms_: steps >= 1 and a finite lr and scale_lr > 0, got {steps}, {lr} and {scale_lr}")
    if not (norms or scales):
        raise ValueError("tune_norms_: nothing to tune (norms=False, scales=False)")


@contextlib.contextmanager
def _tuning_mode(model, params: list):
    """Only ``params`` take gradients, training kernels, train mode and gradient checkpointing (one layer's
    dequantized weights held at a time) inside; every parameter's flag and gradient, every module's mode and the
    model's kernels as before on the way out, error or not."""
    tuned = {id(p) for p in params}
    saved_grads = [p.grad for p in params]
    requires = {name: p.requires_grad for name, p in model.named_parameters()}
    modes = {name: m.training for name, m in model.named_modules()}
    saved = (model.kernels, model.gradient_checkpointing)
    try:
        for p in model.parameters():
            p.requires_grad_(id(p) in tuned)
        model.kernels = _training_kernels(saved[0].context)
        model.train(True)
        model.gradient_checkpointing = True
        yield
    finally:
        model.kernels, model.gradient_checkpointing = saved
        for name, m in model.named_modules():
            m.training = modes[name]
        for name, p in model.named_parameters():
            p.requires_grad_(requires[name])
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def tune_norms_(model, windows: list[torch.Tensor], targets: list[torch.Tensor], steps: int = NORM_STEPS,
                lr: float = NORM_LR, seed: int = 0, log=None, norms: bool = True, scales: bool = False,
                scale_lr: float = SCALE_LR) -> dict:  # fmt: skip  # size: one tuning run's keyword options
    """Fit the quantized ``model``'s RMSNorm weights (``norms``) and / or its projections' scales (``scales``:
    ``scaled_modules``, each scale's relative change at ``scale_lr``) in place to ``targets`` (``norm_targets`` of the
    float model on the same ``windows``): ``steps`` Adam steps (``lr``), one window each, minimizing the KL divergence
    of the quantized model's next-token distributions from the float model's. With two windows or more every
    HOLD_OUT-th (at least one) is held out (``split_windows``): the others are visited in passes of a seeded order,
    and the values kept are those after the pass with the lowest KL on the held-out windows, or the untuned ones (one
    warning) if no pass lowered it. With one window, it both takes the steps and judges them. The LM head must still
    be float (the target logits are made by it; quantize the head after tuning). Every other parameter and buffer and
    the model's kernels, modes and flags are as before on return; on an error the norms and scales are too (the
    scales' buffers are the same tensors, written in place). ``log(pass, step KL, judged KL)`` after each pass.
    Returns {"before", "after": the judging windows' mean KL per token untuned and as kept, "held_out": how many
    windows judged (0: the one window), "passes": [each pass's KL over its steps, measured as the weights moved],
    "tuned": whether tuned values were kept}."""
    _check_tuning(model, windows, targets, steps, lr, scale_lr, norms, scales)
    train, held = split_windows(len(windows))
    judge = held or train
    what = ["norm"] * norms + ["scale"] * scales
    params = [p for _, p in norm_weights(model)] if norms else []
    start = [p.detach().clone() for p in params]
    scaled = scaled_modules(model) if scales else []
    if scales and not scaled:
        raise ValueError("scale tuning: no projection is quantized in a format with float scales "
                         f"({', '.join(SCALED_FORMATS)})")  # fmt: skip
    scale0 = [m._buffers["scales"] for m in scaled]
    scale_start = [s.clone() for s in scale0]  # an error while the kept values are written puts these back
    ratios = [torch.zeros(s.shape, dtype=torch.float32, device=s.device, requires_grad=True) for s in scale0]
    runtime = getattr(model, "runtime", None)
    generator = torch.Generator().manual_seed(seed)
    # float32 copies take Adam's steps (in bf16 a weight just below 1 moves by 2^-8 or more: steps of about lr would
    # round away); the model's weights are these, rounded to its dtype, after every step
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    groups = [{"params": masters, "lr": lr}] * bool(masters) + [{"params": ratios, "lr": scale_lr}] * bool(ratios)
    optimizer = torch.optim.Adam(groups)
    with _tuning_mode(model, params):
        done = False
        try:
            _set_scales(scaled, scale0, ratios)
            before = best = _mean_kl(model, windows, targets, judge)
            best_norms, best_ratios, passes = None, None, []
            for first in range(0, steps, len(train)):
                order = torch.randperm(len(train), generator=generator).tolist()[: steps - first]
                passes.append(_pass(model, [train[i] for i in order], windows, targets, params, masters, optimizer,
                                    runtime, (scaled, scale0, ratios)))  # fmt: skip
                if not held and first + len(train) < steps:  # one window: it judges the last pass only
                    continue
                kl = _mean_kl(model, windows, targets, judge)
                if kl < best:
                    best, best_norms = kl, [p.detach().clone() for p in params]
                    best_ratios = [r.detach().clone() for r in ratios]
                if log is not None:
                    log(len(passes), passes[-1], kl)
            with torch.no_grad():
                for p, value in zip(params, best_norms or start):
                    p.copy_(value)
                tuned_scales = [
                    _scaled(s0, r) for s0, r in zip(scale0, best_ratios or [])
                ]  # all, before any is written
                for s0, value in zip(scale0, tuned_scales):
                    s0.copy_(value)  # rounded to the stored dtype: the kernels and a save read this buffer
            if best_norms is None:
                where = "held-out calibration windows" if held else "calibration window"
                logger.warning("warning: %s tuning: no pass lowered the KL to the float model on the %s (%.5f per "
                               "token): the %ss are kept as they were", " and ".join(what), where, before,
                               "s and ".join(what))  # fmt: skip
            done = True
        finally:
            if not done:
                with torch.no_grad():
                    for p, value in zip(params + scale0, start + scale_start):
                        p.copy_(value)
            for m, s0 in zip(scaled, scale0):
                m._buffers["scales"] = s0
    return {"before": before, "after": best, "held_out": len(held), "passes": passes, "tuned": best_norms is not None}


def scaled_modules(model) -> list[QLinear]:
    """The quantized projections whose float ``scales`` scale tuning moves (int8, fp8, fp8_block, int4; not a GGUF's,
    whose scales live inside its blocks; not a quantized LM head, which makes the targets)."""
    head = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, QLinear) and m is not head and m.format in SCALED_FORMATS]


def _scaled(s0: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """s0 * (1 + ratio) rounded to s0's dtype (what a save stores), the gradient passed straight through the
    rounding; float32."""
    s = s0.float() * (1.0 + ratio)
    return s + (s.to(s0.dtype).float() - s).detach()


def _set_scales(scaled, scale0, ratios) -> None:
    """Each module's scales buffer replaced by its tuned value (a float32 tensor in the ratios' graph, also when the
    caller runs under no_grad)."""
    with torch.enable_grad():
        for m, s0, r in zip(scaled, scale0, ratios):
            m._buffers["scales"] = _scaled(s0, r)


def _training_kernels(ctx):
    """The run's ops resolved for training (each with a backward): the quantized ones run their references. Quiet:
    the fallbacks it logs (an inference kernel without a backward) are this step's, not the run's."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return resolve(dataclasses.replace(ctx, training=True))
    finally:
        logger.setLevel(level)


def _pass(
    model, order: list, windows, targets, params, masters, optimizer, runtime, scales
) -> float:  # size: a pass's state
    """One Adam step per window of ``order``; their mean KL per token (as the weights moved)."""
    total = tokens = 0
    with torch.enable_grad():
        for i in order:
            loss, n = _kl(model, windows[i], targets[i])
            for p in params + scales[2]:
                p.grad = None
            loss.backward()
            if runtime is not None:
                runtime.mark_step()  # HPU lazy mode: the backward's graph runs here (as the Trainer does)
            for p, master in zip(params, masters):
                master.grad = None if p.grad is None else p.grad.float()  # None: not used, not moved
            optimizer.step()
            with torch.no_grad():
                for p, master in zip(params, masters):
                    p.copy_(master)
            _set_scales(*scales)
            if runtime is not None:
                runtime.mark_step()
            total, tokens = total + loss.item() * n, tokens + n
    return total / tokens


def _kl(model, ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The mean KL(float || quantized) per token of one window ([L] or [B, L]), and its token count."""
    ids = ids.to(model.device)
    ids = ids[None] if ids.dim() == 1 else ids
    logp = F.log_softmax(model(ids).logits.float(), dim=-1).flatten(0, -2)
    with torch.no_grad():  # the float model's logits: its final-norm output through the same (float) head
        ref = F.log_softmax(model.lm_head(target.to(model.dtype)).float(), dim=-1).flatten(0, -2)
    return F.kl_div(logp, ref, log_target=True, reduction="batchmean"), logp.shape[0]


@torch.no_grad()
def _mean_kl(model, windows: list, targets: list, which: list) -> float:
    total = tokens = 0
    for i in which:
        loss, n = _kl(model, windows[i], targets[i])
        total, tokens = total + loss.item() * n, tokens + n
    return total / tokens


def tuned_norm_count(model) -> int:
    """How many numbers norm tuning fits in ``model`` (its RMSNorm weights)."""
    return sum(p.numel() for _, p in norm_weights(model))


def tuned_scale_count(model) -> int:
    """How many numbers scale tuning fits in ``model`` (its quantized projections' scales)."""
    return sum(m.scales.numel() for m in scaled_modules(model))
