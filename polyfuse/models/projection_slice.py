"""``ProjectionSlice``: transformers' ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj`` on polyfuse's
fused projections, so that tools which find layers by those names (PEFT's ``target_modules``) find them.

A slice is an ``nn.Linear`` (PEFT's LoRA wraps only ``nn.Linear`` instances) that owns no parameter: ``weight`` and
``bias`` are views of rows ``[start, stop)`` of the fused module's current weight and bias, looked up on every access
through the owning module (``Attention`` / ``MLP``), so ``.to()``, ``load_state_dict``, FSDP2's parameter swaps and a
quantized replacement of the fused module are seen as they happen. The owner is held outside ``nn.Module``'s
registry (no cycle in ``named_modules``), and nothing is added to ``state_dict()`` or ``named_parameters()``: saving,
loading, tensor-parallel sharding and quantization see the model exactly as without slices.

While every slice of a fused projection is its own ``ProjectionSlice``, the model runs the one fused GEMM
(``decoder.py``, ``fused_slices_intact``); once a tool has replaced one (a PEFT ``lora.Linear`` wrapping it), each
part is projected by its own module. PEFT's ``merge_and_unload`` adds the adapter's delta into ``weight.data``, the
fused weight's rows, and puts the slice back: the fused GEMM runs again, on the merged weight. With
``safe_merge=True`` PEFT assigns a merged copy to ``weight.data`` instead: the rows a slice hands out
(:class:`SliceRows`) copy what is assigned to their ``.data`` into the fused weight, so that merge lands too.
"""

from __future__ import annotations

import torch
from torch import nn


class SliceRows(torch.Tensor):
    """The rows of a fused weight as a slice hands them out: the same view (autograd included), whose ``.data``
    assignment writes into those rows instead of detaching the view from them (``weight.data = merged``: PEFT's
    safe merge). Operations on it give plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        rows = torch.Tensor.data.__get__(self)
        if tuple(value.shape) != tuple(rows.shape):
            raise ValueError(
                f"a projection slice holds {tuple(rows.shape)} rows of its fused weight; cannot assign "
                f"{tuple(value.shape)}"
            )
        if value.data_ptr() != rows.data_ptr():
            rows.copy_(value)


class ProjectionSlice(nn.Linear):
    """Rows ``[start, stop)`` of ``owner.<fused>`` (an ``nn.Linear``) as an ``nn.Linear`` without parameters."""

    def __init__(self, owner: nn.Module, fused: str, start: int, stop: int):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a weight of its own
        self.in_features = getattr(owner, fused).in_features
        self.out_features = stop - start
        self.fused_name, self.start, self.stop = fused, start, stop
        object.__setattr__(self, "_owner", owner)  # a plain attribute: not a submodule of the slice

    def fused(self) -> nn.Module:
        """The fused module as the owner holds it now."""
        return getattr(self._owner, self.fused_name)

    def _rows(self, name: str):
        t = getattr(self.fused(), name, None)
        if name == "weight" and not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{self.fused_name} is a {type(self.fused()).__name__} without a dense weight (a quantized "
                f"projection?): its slice {self.start}:{self.stop} has no weight to read"
            )
        if t is None:
            return None
        rows = t[self.start : self.stop]
        return rows.as_subclass(SliceRows) if type(rows) is torch.Tensor else rows  # DTensors (FSDP2) as they are

    @property
    def weight(self) -> torch.Tensor:
        return self._rows("weight")

    @property
    def bias(self):
        return self._rows("bias")

    def reset_parameters(self) -> None:
        """Nothing to reset: the rows belong to the fused module (whose own initialization covers them)."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows {self.start}:{self.stop} of {self.fused_name}"


def fused_slices_intact(fused: nn.Module, *slices: nn.Module) -> bool:
    """True while every one of ``slices`` of ``fused`` is still a bare ``ProjectionSlice`` (nothing wraps or replaced
    it): the fused GEMM may run. Otherwise the slices run one by one, and a wrapped ``fused`` module (PEFT's
    ``target_modules="all-linear"`` adapts both the fused module and its slices) is refused: its own adapter would
    never run."""
    if all(type(m) is ProjectionSlice for m in slices):
        return True
    plain = isinstance(fused, nn.Linear) and type(fused).forward is nn.Linear.forward
    if not (plain or hasattr(fused, "quantized_weight")):  # a QLinear is plain too
        bare = [m if isinstance(m, ProjectionSlice) else getattr(m, "base_layer", None) for m in slices]
        name = next((m.fused_name for m in bare if isinstance(m, ProjectionSlice)), "the fused projection")
        raise ValueError(
            f"{name} is wrapped ({type(fused).__name__}) and its parts are adapted one by one too, so its own "
            f"adapter would never run: adapt either {name} or transformers' names (q/k/v_proj, gate/up_proj), not "
            "both (PEFT's target_modules='all-linear' selects both)"
        )
    return False
