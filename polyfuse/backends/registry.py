"""The op registry: ops are declared once, backends register implementations, selection happens once per model build.

Vocabulary:
  * an *op* (``OpSpec``) is an abstract function with a documented signature and a native PyTorch reference;
  * an *implementation* (``Implementation``) is one way to compute an op on some device types, with a probe that
    says whether it can run in a given ``SelectionContext`` (package importable, device present, dtype supported);
  * ``resolve(ctx)`` picks one implementation per op and returns ``Kernels``: a namespace the model calls, plus a
    report of what was chosen and why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


logger = logging.getLogger("polyfuse")

ENV_OVERRIDES = "POLYFUSE_OPS"
NATIVE = "native"


@dataclass(frozen=True)
class OpSpec:
    name: str
    signature: str
    native: Callable
    doc: str = ""
    # Flag of the run that turns the fused implementations of this op on (None: on by default).
    enable_flag: Optional[str] = None
    # False for ops only used at inference (a training run gets the reference, without a fallback warning).
    training: bool = True


@dataclass(frozen=True)
class Implementation:
    op: str
    name: str
    backend: str
    devices: tuple[str, ...]  # device types, or ("*",) for any
    fn: Callable
    priority: int = 0  # higher wins among usable implementations
    probe: Optional[Callable[["SelectionContext"], Optional[str]]] = None  # None -> usable; str -> why not
    supports_backward: bool = False
    note: str = ""  # what the implementation does per call when that depends on the input (shown in the report)

    def unusable_reason(self, ctx: "SelectionContext") -> Optional[str]:
        if "*" not in self.devices and ctx.device.type not in self.devices:
            return f"needs device {'/'.join(self.devices)}, run is on {ctx.device.type}"
        if ctx.training and not self.supports_backward:
            return "has no backward (training run)"
        if self.probe is not None:
            return self.probe(ctx)
        return None


@dataclass
class SelectionContext:
    device: torch.device
    dtype: torch.dtype = torch.float32
    flags: dict = field(default_factory=dict)
    training: bool = False
    overrides: str = ""

    def flag(self, name: str, default=False):
        return self.flags.get(name, default)


@dataclass
class Choice:
    op: str
    implementation: Implementation
    reason: str
    skipped: list = field(default_factory=list)  # [(impl name, why)]


_OPS: dict[str, OpSpec] = {}
_IMPLS: dict[str, list[Implementation]] = {}


def declare(spec: OpSpec) -> OpSpec:
    if spec.name in _OPS:
        raise ValueError(f"op {spec.name!r} is declared twice")
    _OPS[spec.name] = spec
    _IMPLS.setdefault(spec.name, [])
    register(Implementation(spec.name, NATIVE, NATIVE, ("*",), spec.native, priority=-1000, supports_backward=True))
    return spec


def register(impl: Implementation) -> Implementation:
    if impl.op not in _OPS:
        raise ValueError(f"cannot register {impl.name!r}: op {impl.op!r} is not declared")
    impls = _IMPLS[impl.op]
    if any(i.name == impl.name for i in impls):
        raise ValueError(f"implementation {impl.name!r} of op {impl.op!r} is registered twice")
    impls.append(impl)
    impls.sort(key=lambda i: -i.priority)
    return impl


def ops() -> dict[str, OpSpec]:
    _load_backends()
    return dict(_OPS)


def implementations(op: str) -> list[Implementation]:
    _load_backends()
    if op not in _IMPLS:
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(sorted(_OPS))}")
    return list(_IMPLS[op])


def parse_overrides(text: str) -> dict[str, str]:
    """``"+rms_norm,-rotary,attention=sdpa"`` -> {"rms_norm": "+", "rotary": "-", "attention": "sdpa"}.

    ``+op`` turns the op's fused implementations on even when the run's flags leave them off, ``-op`` forces the
    native reference, ``op=name`` asks for one implementation by name. Later entries win.
    """
    out: dict[str, str] = {}
    for raw in (text or "").split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" in item:
            op, name = (s.strip() for s in item.split("=", 1))
        elif item[0] in "+-":
            op, name = item[1:].strip(), item[0]
        else:
            raise ValueError(f"bad op override {item!r}: use +op, -op or op=implementation")
        if op not in _OPS:
            raise ValueError(f"bad op override {item!r}: unknown op {op!r} (known: {', '.join(sorted(_OPS))})")
        out[op] = name
    return out


def select(op: str, ctx: SelectionContext, overrides: Optional[dict] = None) -> Choice:
    spec = _OPS[op]
    impls = implementations(op)
    native = next(i for i in impls if i.name == NATIVE)
    want = (overrides or {}).get(op)
    if want == "-":
        return Choice(op, native, "forced native by override -" + op)
    if want not in (None, "+", "-"):
        named = [i for i in impls if i.name == want]
        if not named:
            names = ", ".join(i.name for i in impls)
            raise ValueError(f"op {op!r} has no implementation {want!r} (registered: {names})")
        why = named[0].unusable_reason(ctx)
        if why is None:
            return Choice(op, named[0], f"requested by override {op}={want}")
        logger.warning("polyfuse: %s: requested %s is unusable (%s); falling back", op, want, why)
        skipped = [(want, why)]
    else:
        skipped = []
    if ctx.training and not spec.training:
        return Choice(op, native, "inference-only op, not used in training", skipped)
    if spec.enable_flag and want != "+" and not ctx.flag(spec.enable_flag):
        return Choice(op, native, f"--{spec.enable_flag} not set", skipped)
    for impl in impls:
        if impl is native or any(impl.name == s[0] for s in skipped):
            continue
        why = impl.unusable_reason(ctx)
        if why is None:
            reason = "best usable for " + ctx.device.type
            passed_over = [n for n, w in skipped if not w.startswith("needs device")]
            if passed_over:
                reason += f" (skipped {', '.join(passed_over)})"
            return Choice(op, impl, reason, skipped)
        if "*" in impl.devices or ctx.device.type in impl.devices:
            # Only implementations meant for this device are worth a log line.
            logger.info("polyfuse: %s: %s unusable (%s); trying next", op, impl.name, why)
        skipped.append((impl.name, why))
    relevant = [(n, w) for n, w in skipped if not w.startswith("needs device")]
    reason = "reference"
    if relevant:
        reason = "fallback: " + "; ".join(f"{n}: {w}" for n, w in relevant)
        logger.warning("polyfuse: %s falls back to native (%s)", op, "; ".join(f"{n}: {w}" for n, w in relevant))
    elif spec.enable_flag and ctx.flag(spec.enable_flag):
        # The run asked for this op's fused kernels by flag and the device has none: say so once.
        reason = f"fallback: --{spec.enable_flag} has no implementation on {ctx.device.type}"
        logger.warning("polyfuse: --%s: no fused %s on %s; the native one runs", spec.enable_flag, op, ctx.device.type)
    return Choice(op, native, reason, skipped)


_warned: set = set()


def warn_call_fallback(op: str, impl: str, why: str) -> None:
    """For kernels that see, at call time, an input they cannot take (a shape, a layout): one warning per cause,
    then the native reference runs. Never a wrong result, never a warning per token."""
    if (op, impl, why) not in _warned:
        _warned.add((op, impl, why))
        logger.warning("polyfuse: %s: %s cannot take this input (%s); the native one runs", op, impl, why)


class Kernels:
    """The resolved implementation of every op for one model build. Call ops as attributes: ``k.rms_norm(x, w, eps)``."""

    def __init__(self, choices: dict[str, Choice], ctx: SelectionContext):
        self.choices = choices
        self.context = ctx
        for name, choice in choices.items():
            setattr(self, name, choice.implementation.fn)
        self._fused = {n for n, c in choices.items() if c.implementation.name != NATIVE}

    def fused(self, op: str) -> bool:
        """True when ``op`` got an implementation other than its native reference."""
        return op in self._fused

    def report(self) -> str:
        width = max(len(n) for n in self.choices)
        lines = [f"polyfuse backends (device={self.context.device.type}, dtype={str(self.context.dtype)[6:]}):"]
        for name, c in self.choices.items():
            impl = c.implementation
            note = f" [{impl.note}]" if impl.note else ""
            lines.append(f"  {name:<{width}}  {impl.backend + ':' + impl.name:<24} {c.reason}{note}")
        return "\n".join(lines)

    def compiled(self, backend: str = "inductor") -> "Kernels":
        """The same choices with every op function wrapped in torch.compile. Standalone functions, not module
        forwards bound to ``self``, so decoding does not recompile per layer or per token."""
        out = Kernels(self.choices, self.context)
        for name in self.choices:
            setattr(out, name, torch.compile(getattr(self, name), backend=backend, dynamic=None))
        return out

    def as_dict(self) -> dict:
        return {
            n: {"backend": c.implementation.backend, "implementation": c.implementation.name, "reason": c.reason}
            for n, c in self.choices.items()
        }


def resolve(ctx: SelectionContext) -> Kernels:
    """Pick one implementation per declared op. Called once when a model is built, never per token."""
    _load_backends()
    overrides = parse_overrides(os.environ.get(ENV_OVERRIDES, ""))
    overrides.update(parse_overrides(ctx.overrides))
    return Kernels({op: select(op, ctx, overrides) for op in _OPS}, ctx)


_loaded = False


def _load_backends() -> None:
    """Import the op declarations and every backend's registrations (each backend imports lazily inside probes)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import polyfuse.ops  # noqa: F401  (declares ops and their native references)
    from polyfuse.backends import cuda, hpu  # noqa: F401  (register implementations)
    from polyfuse.backends.cuda import runtime as _cuda_runtime  # noqa: F401  (registers the CUDA runtime)
