"""TEST DOUBLE (stand-in) of ``neural_compressor.torch.quantization``'s fp8 flow, as optimum-habana calls it
(text-generation utils.py): ``FP8Config.from_json_file``, ``prepare``, ``convert``, ``finalize_calibration``. Not
Intel's software: the real package runs only with Habana's bridge. What it models, from INC 3.x's source
(algorithms/fp8_quant):

* the JSON's ``mode`` (MEASURE / QUANTIZE), ``observer`` (maxabs only here), ``dump_stats_path`` and
  ``blocklist`` / ``allowlist`` names; ``measure`` / ``quantize`` as the config's properties;
* ``prepare``: every ``torch.nn.Linear`` not blocked (``lm_head`` is, as INC's default blocks it) is replaced in its
  parent by a patched module whose forward records its input's and weight's largest magnitude;
* ``finalize_calibration``: the measurements written as INC names them, ``<dump_stats_path>_hooks_maxabs.json`` and
  ``_hooks_maxabs_mod_list.json`` (INC also writes an ``.npz``; not modelled), the folder created;
* ``convert``: the measurements read back (a missing file is an error, as INC's), each patched Linear replaced by
  an fp8 module in INC's static form: the weight as a per-channel-scaled e4m3 ``[K, N]`` copy, the input cast with
  its measured scale (``maxabs_hw``: the largest input at the device's fullscale), one ``fp8_gemm_v2`` with
  ``trans_B=False``. Gaudi2's 240 or Gaudi3's 448 as the double's device says.

Every call is recorded in ``habana_frameworks.CALLS`` when the habana double is imported."""

import json
import os
import sys

import torch


MODES = ("MEASURE", "QUANTIZE")


def _record(name, *args):
    double = sys.modules.get("habana_frameworks")
    if double is not None and getattr(double, "TEST_DOUBLE", False):
        double.record(name, *args)


class FP8Config:
    def __init__(self, mode="AUTO", observer="maxabs", scale_method="maxabs_hw", dump_stats_path="./hqt_output/measure",
                 blocklist=None, allowlist=None, method="HOOKS", **rest):  # fmt: skip
        if mode not in MODES:
            raise ValueError(f"FP8Config (stand-in): mode {mode!r} is not modelled (MEASURE or QUANTIZE)")
        if observer != "maxabs":
            raise ValueError(f"FP8Config (stand-in): observer {observer!r} is not modelled (maxabs)")
        self.mode, self.observer, self.scale_method = mode, observer, scale_method
        self.dump_stats_path = dump_stats_path
        self.blocked = set((blocklist or {}).get("names", [])) | {"lm_head"}
        self.rest = rest

    @classmethod
    def from_json_file(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))

    @property
    def measure(self):
        return self.mode == "MEASURE"

    @property
    def quantize(self):
        return self.mode == "QUANTIZE"

    @property
    def measure_file(self):
        return f"{self.dump_stats_path}_hooks_{self.observer}.json"


class PatchedLinear(torch.nn.Module):
    """A measured Linear: its forward is the Linear's, recording max |input| and max |weight|."""

    def __init__(self, name, mod):
        super().__init__()
        self.name, self.mod = name, mod
        self.weight, self.bias = mod.weight, mod.bias
        self.in_features, self.out_features = mod.in_features, mod.out_features
        self.input_max = 0.0

    def forward(self, x):
        self.input_max = max(self.input_max, float(x.detach().abs().amax()))
        return torch.nn.functional.linear(x, self.weight, self.bias)


class QuantizedLinear(torch.nn.Module):
    """INC's static fp8 Linear on Gaudi: per-channel weight scales, one measured input scale, fp8_gemm_v2 with the
    weight as a [K, N] e4m3 copy and trans_B=False."""

    def __init__(self, name, mod, input_max, fullscale):
        super().__init__()
        w = mod.weight.detach()
        self.name, self.bias = name, mod.bias
        self.in_features, self.out_features = mod.in_features, mod.out_features
        w_max = w.float().abs().amax(dim=1).clamp(min=1e-12)
        self.w_scale = (w_max / fullscale).float()  # [N]
        w8 = torch.ops.hpu.cast_to_fp8_v2((w.float() / self.w_scale[:, None]), None, False, False,
                                          torch.float8_e4m3fn)[0]  # fmt: skip
        self.w8_t = w8.t().contiguous()  # [K, N]
        self.in_scale = torch.tensor(max(input_max, 1e-12) / fullscale, dtype=torch.float32, device=w.device)

    def forward(self, x):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        x8 = torch.ops.hpu.cast_to_fp8_v2(x2, 1.0 / self.in_scale, False, False, torch.float8_e4m3fn)[0]
        y = torch.ops.hpu.fp8_gemm_v2(x8, False, self.w8_t, False, None, x.dtype, self.in_scale, self.w_scale, None,
                                      False)  # fmt: skip
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def _linears(model, blocked):
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is torch.nn.Linear and name not in blocked and full not in blocked:
                yield parent, name, full, child


def _fullscale():
    from habana_frameworks.torch._fp8_ops import fullscale

    return fullscale(torch.float8_e4m3fn)


def prepare(model, config):
    patched = 0
    for parent, name, full, child in list(_linears(model, config.blocked)):
        setattr(parent, name, PatchedLinear(full, child))
        patched += 1
    model._inc_config = config
    _record("inc.prepare", config.mode, patched)
    return model


def finalize_calibration(model):
    config = model._inc_config
    stats = {m.name: {"inputs": [m.input_max], "params": {"weight": float(m.weight.detach().abs().amax())}}
             for m in model.modules() if isinstance(m, PatchedLinear)}  # fmt: skip
    folder = os.path.dirname(config.dump_stats_path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(config.measure_file, "w", encoding="utf-8") as f:
        json.dump({"GlobalRank": None, "LocalRank": None, "Mode": "DynamicRange", "Nodes": stats}, f, indent=1)
    with open(config.measure_file.replace(".json", "_mod_list.json"), "w", encoding="utf-8") as f:
        json.dump(sorted(stats), f)
    _record("inc.finalize_calibration", config.measure_file, len(stats))


def convert(model, config):
    if not os.path.isfile(config.measure_file):
        raise FileNotFoundError(f"measurement file {config.measure_file} not found: run with a MEASURE config first")
    with open(config.measure_file, encoding="utf-8") as f:
        nodes = json.load(f)["Nodes"]
    top = _fullscale()
    converted = 0
    for parent, name, full, child in list(_linears(model, config.blocked)):
        if full not in nodes:
            raise ValueError(f"{full} has no measurement in {config.measure_file}")
        setattr(parent, name, QuantizedLinear(full, child, nodes[full]["inputs"][0], top))
        converted += 1
    _record("inc.convert", config.measure_file, converted)
    return model
