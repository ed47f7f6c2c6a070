"""TEST DOUBLE of ``habana_frameworks.torch.hpu.graphs``: ``wrap_in_hpu_graph`` with the real cache semantics.

``wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None)``
replaces ``module.forward`` in place and returns the module, like the real one (hpu/graphs.py in Habana's bridge):

* ``bypass_hpu_graphs=True`` runs the plain forward ("hpu_graph_bypass");
* every other call is keyed by :func:`input_hash` of ``(args, kwargs)``: a tensor by its shape, dtype and *view*
  (storage offset and strides, as the real ``_hpu_C.get_view_hash``), anything else by value. So a view that moves
  along its base (``t[i:i + 1]``) is a new key every time, and so is every distinct Python int;
* a new key captures a graph ("hpu_graph_capture"): the forward runs once, its ops are recorded (``_device.capture``)
  and the graph keeps the input tensors it was given and the outputs it returned; host tensors are refused;
* a known key replays ("hpu_graph_replay"): the new inputs are *copied into the capture-time input tensors*, the
  recorded ops run again on those tensors (``_device.replay``: no Python of the module runs, so a branch its Python
  took on a tensor's value at capture is taken again whatever the new inputs say), their results land in the
  capture-time output tensors, and those same output objects are returned (aliases of one another, as on a Gaudi);
* with ``max_graphs`` graphs cached, a new key runs the plain forward ("hpu_graph_over_limit");
* ``module.clear_cache()`` drops every graph.

As on a Gaudi, a replay runs no Python at all.
"""

import functools

import torch

from habana_frameworks import record
from habana_frameworks.torch import _device


def _view_key(t):
    return (tuple(t.shape), t.dtype, t.device.type, t.storage_offset(), tuple(t.stride()))


def input_hash(obj):
    if isinstance(obj, dict):
        return input_hash(tuple(obj.items()))
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return hash(tuple(input_hash(o) for o in obj))
    if torch.is_tensor(obj):
        return hash(_view_key(obj))
    return hash(obj)


def _host_inputs_refused(inputs):
    for t in torch.utils._pytree.tree_leaves(inputs):
        if torch.is_tensor(t) and not isinstance(t, _device.HpuTensor) and t.dim() > 0:
            raise RuntimeError(f"wrap_in_hpu_graph (test double): input of shape {tuple(t.shape)} is a host tensor")


def _copy_to(dst, src):
    if isinstance(dst, dict):
        for (dk, dv), (sk, sv) in zip(dst.items(), src.items()):
            assert dk == sk
            _copy_to(dv, sv)
    elif isinstance(dst, (list, tuple)) and not isinstance(dst, torch.Size):
        for d, s in zip(dst, src):
            _copy_to(d, s)
    elif torch.is_tensor(dst) and dst is not src:
        dst.copy_(src)


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"wrap_in_hpu_graph expects a torch.nn.Module, got {type(module).__name__}")
    record("wrap_in_hpu_graph", module, max_graphs=max_graphs)
    cache = {}
    orig_fwd = module.forward

    @functools.wraps(orig_fwd)
    def forward(*args, **kwargs):
        if kwargs.pop("bypass_hpu_graphs", False):
            record("hpu_graph_bypass")
            return orig_fwd(*args, **kwargs)
        inputs = (args, kwargs)
        h = input_hash(inputs)
        cached = cache.get(h)
        if cached is None:
            if max_graphs is not None and len(cache) == max_graphs:
                record("hpu_graph_over_limit")
                return orig_fwd(*args, **kwargs)
            record("hpu_graph_capture", h)
            _host_inputs_refused(inputs)
            outputs, ops = _device.capture(orig_fwd, *args, **kwargs)
            cache[h] = (inputs, outputs, ops)
            return outputs
        record("hpu_graph_replay", h)
        graph_inputs, graph_outputs, ops = cached
        _copy_to(graph_inputs, inputs)
        _device.replay(ops)  # the captured ops on the capture-time tensors: no Python of the module runs
        return graph_outputs

    module.forward = forward
    module.clear_cache = cache.clear
    return module


class ModuleCacher:
    """``ModuleCacher(max_graphs=10)(model=module, inplace=True)``: the bridge caches each module's forward and
    backward in HPU graphs (training). Here the call is recorded ("ModuleCacher") and the module runs as it is: the
    capture of a training step is not modelled."""

    def __init__(self, max_graphs=10):
        self.max_graphs = max_graphs

    def __call__(self, model, inplace=True, allow_unused_input=False, have_grad_accumulation=False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ModuleCacher expects a torch.nn.Module, got {type(model).__name__}")
        record("ModuleCacher", model, inplace=inplace)
        return model
