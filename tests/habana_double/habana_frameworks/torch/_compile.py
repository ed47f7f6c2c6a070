"""TEST DOUBLE of Habana's ``hpu_backend`` torch.compile backend (registered in eager mode only, as the bridge does).

The real backend lowers dynamo's graph through AOT autograd to ATen ops and compiles them for the device. The double
does the same lowering (``aot_autograd``) and refuses what the device could not compile: a graph input on another
device (the HPU compiles for HPU tensors) and a node that is no ATen / prims / ``hpu::`` operator (a Triton kernel,
an opaque Python callable; SymInt arithmetic of dynamic sizes passes). Each compiled graph is recorded as
``("hpu_backend.compile", n_nodes)``, ``("hpu_backend.options", the options torch.compile passed)`` and
``("hpu_backend.graph", [op names])``, so a test can count the graphs dynamo split a model into.
"""

import sys

import torch


def record(name, *args):
    """Into the double imported now: the backend stays registered with dynamo after a test forgets the double."""
    double = sys.modules.get("habana_frameworks")
    if double is not None and getattr(double, "TEST_DOUBLE", False):
        double.CALLS.append((name, args, {}))  # not record(): that one is silent while torch.compile runs


def _check_inputs(example_inputs):
    """dynamo's graph inputs: the HPU compiles for HPU tensors, not host ones."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type != "hpu":
            raise RuntimeError(f"hpu_backend (test double): graph input of shape {tuple(t.shape)} is on "
                               f"{t.device.type}, not an HPU tensor")  # fmt: skip


def _check_graph(gm: torch.fx.GraphModule):
    """AOT's ATen graph: every node an ATen / prims / hpu operator (what the device can compile)."""
    names = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        sym_arithmetic = getattr(target, "__module__", None) in ("_operator", "operator", "math") or str(
            target
        ).startswith("<function sym_")  # sizes of dynamic shapes (SymInt arithmetic), computed on the host
        if not (isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or sym_arithmetic):
            raise RuntimeError(f"hpu_backend (test double): cannot compile {target!r} for the HPU (not an ATen op)")
        names.append(str(target))
    return names


def hpu_backend(gm, example_inputs, **kwargs):
    from torch._dynamo.backends.common import aot_autograd

    _check_inputs(example_inputs)
    record("hpu_backend.compile", len(gm.graph.nodes))
    record("hpu_backend.options", dict(kwargs.get("options") or {}))

    def compile_fn(graph, inputs):
        record("hpu_backend.graph", _check_graph(graph))
        return graph.forward

    return aot_autograd(fw_compiler=compile_fn, bw_compiler=compile_fn)(gm, example_inputs)


def register():
    try:
        from torch._dynamo import list_backends, register_backend
    except ImportError:  # pragma: no cover - torch without dynamo
        return
    if "hpu_backend" in list_backends(exclude_tags=()):
        return
    register_backend(hpu_backend, name="hpu_backend")
