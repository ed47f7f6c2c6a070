"""The op registry: ops are declared once, backends register implementations, selection happens once per model build.

Vocabulary:
  * an *op* (``OpSpec``) is an abstract function with a documented signature and a native PyTorch reference; a
    *composite* op also says how to build it from other ops (``rotary_kv_write`` = rotary + cache write), and that
    definition runs wherever no fused implementation does, so the other ops' own choices (and overrides) hold;
  * an *implementation* (``Implementation``) is one way to compute an op on some device types (and platforms), with
    a probe that says whether it can run in a ``SelectionContext`` (package importable, dtype supported), and
    optionally ``accepts``: a call-time check for inputs it cannot take (a shape, a layout). A declined call goes to
    the registry's next choice for that op, never to a private fallback inside the kernel;
  * ``resolve(ctx)`` picks an ordered chain of implementations per op and returns ``Kernels``: a namespace the model
    calls (``kernels.rms_norm(x, w, eps)``), plus a report of what was chosen and why.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from polyfuse.core import settings
from polyfuse.core.context import SelectionContext
from polyfuse.core.kernel_options import changed
from polyfuse.core.plugins import load_plugins


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
    # compose(kernels) -> function: the op built from other ops, run where no fused implementation is chosen.
    compose: Optional[Callable[["Kernels"], Callable]] = None
    composed_of: tuple = ()  # the ops ``compose`` calls, for the report
    # False where the reference is one library call (linear: F.linear is cuBLAS either way): --torch_compile leaves
    # it as it is rather than compile a graph per input rank, bias and shape for nothing.
    compile: bool = True


@dataclass(frozen=True)
class Implementation:
    op: str
    name: str
    backend: str
    devices: tuple[str, ...]  # device types, or ("*",) for any
    fn: Callable
    priority: int = 0  # higher wins among usable implementations
    probe: Optional[Callable[[SelectionContext], Optional[str]]] = None  # None -> usable; str -> why not
    supports_backward: bool = False
    note: str = ""  # what the implementation does per call when that depends on the input (shown in the report)
    platforms: Optional[tuple[str, ...]] = None  # e.g. ("cuda",): not on ROCm although device.type is "cuda"
    # accepts(*args, **kwargs) -> None (takes the input) or why not; the call then goes to the next choice.
    accepts: Optional[Callable[..., Optional[str]]] = None
    # True when declining is the plan (a GEMV for tuned shapes only): no warning; else one warning per cause. An
    # ``accepts`` can also say so per call by returning a :class:`Planned` reason (another weight format's call).
    quiet_decline: bool = False
    # True: ``fn`` and ``accepts`` take the run's KernelOptions (core/kernel_options.py) as the keyword ``options``.
    options: bool = False

    def unusable_reason(self, ctx: SelectionContext) -> Optional[str]:
        if "*" not in self.devices and ctx.device.type not in self.devices:
            return f"needs device {'/'.join(self.devices)}, run is on {ctx.device.type}"
        if self.platforms is not None and ctx.platform.name not in self.platforms:
            return f"needs platform {'/'.join(self.platforms)}, run is on {ctx.platform.name}"
        if ctx.training and not self.supports_backward:
            return "has no backward (training run)"
        if self.probe is not None:
            return self.probe(ctx)
        return None


@dataclass
class Choice:
    op: str
    implementation: Implementation
    reason: str
    skipped: list = field(default_factory=list)  # [(impl name, why)]
    # Usable implementations after the chosen one, in the order a declined call tries them (native/composite last).
    then: list = field(default_factory=list)

    @property
    def chain(self) -> tuple:
        """The chosen implementation, then the ones a declined call tries, in order."""
        return (self.implementation, *self.then)


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
    load_plugins()
    return dict(_OPS)


def implementations(op: str) -> list[Implementation]:
    load_plugins()
    if op not in _IMPLS:
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(sorted(_OPS))}")
    return list(_IMPLS[op])


def parse_overrides(text: str) -> dict[str, str]:
    """``"+rms_norm,-rotary,attention=sdpa"`` -> {"rms_norm": "+", "rotary": "-", "attention": "sdpa"}.

    ``+op`` turns the op's fused implementations on even when the run's flags leave them off, ``-op`` forces the
    native reference (for a composite op: its definition from the other ops), ``op=name`` asks for one
    implementation by name. Later entries win.
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


def _usable_after(impls, chosen, ctx, skipped_names) -> list[Implementation]:
    """The usable implementations ranked below ``chosen`` (declined calls walk them in order)."""
    out, below = [], False
    for impl in impls:
        if impl is chosen:
            below = True
            continue
        if below and impl.name != NATIVE and impl.name not in skipped_names and impl.unusable_reason(ctx) is None:
            out.append(impl)
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
            reason = "best usable for " + ctx.platform.name
            passed_over = [n for n, w in skipped if not w.startswith(("needs device", "needs platform"))]
            if passed_over:
                reason += f" (skipped {', '.join(passed_over)})"
            then = _usable_after(impls, impl, ctx, {n for n, _ in skipped})
            return Choice(op, impl, reason, skipped, then)
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


class Planned(str):
    """A reason an ``accepts`` returns for a call that was never its to take (a weight format another
    implementation of the op is for): the call goes on down the chain without a warning."""


def warn_declined(op: str, impl: str, why: str, then: str) -> None:
    """One warning per (op, implementation, cause): never a warning per token."""
    if (op, impl, why) not in _warned:
        _warned.add((op, impl, why))
        logger.warning("polyfuse: %s: %s cannot take this input (%s); %s runs", op, impl, why, then)


def _bound(impl: Implementation, options) -> tuple:
    """(fn, accepts) of ``impl`` for a run with these kernel options (a partial: no Python frame per call)."""
    if not impl.options:
        return impl.fn, impl.accepts
    accepts = None if impl.accepts is None else functools.partial(impl.accepts, options=options)
    return functools.partial(impl.fn, options=options), accepts


def _taker(rest: list, terminal: str, args, kwargs, options) -> str:
    """The name of the first of ``rest`` (the chain's later implementations) that accepts the call, else the
    terminal's: what a declined call really runs, for the one warning line (asked only when a warning is due)."""
    for impl in rest:
        accepts = _bound(impl, options)[1]
        if accepts is None or accepts(*args, **kwargs) is None:
            return impl.name
    return terminal


def _guarded(impl: Implementation, nxt: Callable, rest: list, terminal: str, options) -> Callable:
    (fn, accepts), op = _bound(impl, options), impl.op

    def call(*args, **kwargs):
        why = accepts(*args, **kwargs)
        if why is None:
            return fn(*args, **kwargs)
        if not impl.quiet_decline and not isinstance(why, Planned):
            warn_declined(op, impl.name, why, _taker(rest, terminal, args, kwargs, options))
        return nxt(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{op}_{impl.name}"
    return call


def _own_code(fn: Callable, op: str) -> Callable:
    """``fn`` with a code object of its own. Dynamo keys its caches (and its recompile limit) by code object: wrappers
    shared by many ops (a lazy import, an ``accepts`` guard) would otherwise count every op as a recompile of one."""
    import types

    if not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace(co_name=f"{op}_{fn.__code__.co_name}")
    out = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


class Kernels:
    """The resolved implementation of every op for one model build. Call ops as attributes: ``k.rms_norm(x, w, eps)``.

    Each attribute is the chosen implementation; where it declares ``accepts``, a declined call walks the choice's
    remaining usable implementations and ends at the native reference, or the op's composite definition (which
    calls this same namespace, so the other ops' choices hold inside it)."""

    def __init__(self, choices: dict[str, Choice], ctx: SelectionContext):
        self.choices = choices
        self.context = ctx
        for name, choice in choices.items():
            setattr(self, name, self._chain(choice))

    def _terminal(self, op: str) -> tuple[Callable, str]:
        spec = _OPS.get(op)
        if spec is not None and spec.compose is not None:
            return spec.compose(self), "composite " + " + ".join(spec.composed_of)
        impl = next(i for i in _IMPLS[op] if i.name == NATIVE)
        return impl.fn, NATIVE

    def _chain(self, choice: Choice) -> Callable:
        fn, terminal = self._terminal(choice.op)
        if choice.implementation.name == NATIVE:
            return fn
        chain, options = choice.chain, self.context.options
        for i in reversed(range(len(chain))):
            impl = chain[i]
            fn = (
                _bound(impl, options)[0]
                if impl.accepts is None
                else _guarded(impl, fn, chain[i + 1 :], terminal, options)
            )
        return fn

    def report(self) -> str:
        width = max(len(n) for n in self.choices)
        lines = [
            f"polyfuse backends (device={self.context.device.type}, platform={self.context.platform.name}, "
            f"dtype={str(self.context.dtype)[6:]}):"
        ]
        for name, c in self.choices.items():
            impl = c.implementation
            notes = [impl.note] if impl.note else []
            if impl.name == NATIVE and _OPS[name].compose is not None:
                notes.append("composite: " + " + ".join(_OPS[name].composed_of))
            elif impl.accepts is not None:
                notes.append(
                    "declined inputs go to "
                    + (", ".join(i.name for i in c.then) or "")
                    + (", " if c.then else "")
                    + ("composite" if _OPS[name].compose is not None else NATIVE)
                )
            note = "".join(f" [{n}]" for n in notes)
            lines.append(f"  {name:<{width}}  {impl.backend + ':' + impl.name:<24} {c.reason}{note}")
        set_options = changed(self.context.options)
        if set_options:
            lines.append("  kernel options: " + ", ".join(f"{n}={v}" for n, v in set_options.items()))
        return "\n".join(lines)

    def resolve_imports(self) -> None:
        """Import every lazily imported implementation of the chosen chains now (plugins.lazy_function), so that a
        torch.compile trace of code calling them never traces an import."""
        for choice in self.choices.values():
            for impl in choice.chain:
                resolve = getattr(impl.fn, "resolve", None)
                if resolve is not None:
                    resolve()

    def compiled(self, backend: str = "inductor", dynamic=None) -> "Kernels":
        """The same choices with every op that runs its native reference wrapped in torch.compile; fused
        implementations are kernels already and run as they are (tracing their launchers gains nothing and inductor
        cannot lower every launcher's argument preparation). An op that runs its composite definition is not
        compiled itself: it calls its parts through this namespace, each compiled or fused by the same rule. (A
        compiled composite would trace its fused parts' Triton launches into its graph: on the GPU, swiglu_linear's
        composite with the Triton swiglu inside, under inference_mode, gave wrong logits.) Standalone
        functions, not module forwards bound to ``self``, each with its own code object, so decoding does not
        recompile per layer, per token or per op."""
        out = Kernels(self.choices, self.context)
        out.compiled_ops = []
        for name, choice in self.choices.items():
            spec = _OPS[name]
            if choice.implementation.name == NATIVE and spec.compose is None and spec.compile:
                setattr(
                    out, name, torch.compile(_own_code(getattr(out, name), name), backend=backend, dynamic=dynamic)
                )
                out.compiled_ops.append(name)
        return out

    def as_dict(self) -> dict:
        return {
            n: {"backend": c.implementation.backend, "implementation": c.implementation.name, "reason": c.reason}
            for n, c in self.choices.items()
        }


def resolve(ctx: SelectionContext) -> Kernels:
    """Pick one implementation chain per declared op. Called once when a model is built, never per token."""
    load_plugins()
    overrides = run_overrides(ctx)
    return Kernels({op: select(op, ctx, overrides) for op in _OPS}, ctx)


def run_overrides(ctx: SelectionContext) -> dict[str, str]:
    """The run's op overrides: the environment's, then the context's (later entries win). A fused implementation
    that folds another op in (e.g. SwiGLU inside a projection) asks here whether that op was forced native."""
    overrides = parse_overrides(settings.get(ENV_OVERRIDES))
    overrides.update(parse_overrides(ctx.overrides))
    return overrides


def bound(op: str, impl_name: str, ctx: Optional[SelectionContext] = None) -> Callable:
    """What a model calls when ``op`` is given the implementation ``impl_name`` and every other op its native
    reference: declined inputs then reach the native reference or the composite definition. For conformance tests
    and benchmarks; no probe runs."""
    load_plugins()
    ctx = ctx or SelectionContext(torch.device("cpu"))
    native = {o: next(i for i in impls if i.name == NATIVE) for o, impls in _IMPLS.items()}
    choices = {o: Choice(o, n, "reference") for o, n in native.items()}
    impl = next(i for i in _IMPLS[op] if i.name == impl_name)
    choices[op] = Choice(op, impl, "requested")
    return getattr(Kernels(choices, ctx), op)
