"""Intel Neural Compressor's fp8 flow on Gaudi, driven by ``QUANT_CONFIG`` as optimum-habana's run_generation.py
drives it (text-generation utils.py ``setup_quantization`` / ``finalize_quantization``):

* ``QUANT_CONFIG`` names INC's JSON (``FP8Config.from_json_file``). ``mode: MEASURE``: ``prepare(model, config)``
  patches the model's linear modules to record their inputs' and weights' ranges over the runs, and
  ``finalize_calibration(model)`` after them writes the measurement files (``dump_stats_path`` +
  ``_hooks_maxabs.json`` / ``.npz`` / ``_mod_list.json``). ``mode: QUANTIZE``: ``convert(model, config)`` reads
  those files and replaces the modules by fp8 ones (INC's ``fp8_gemm_v2`` with static scales).
* polyfuse's projections dispatch through ``models/decoder.py`` ``project()``, which calls a module with a forward
  of its own instead of reading its weight: INC's patched modules therefore run as they do in a transformers model.
* Without ``neural_compressor``, or off a Gaudi, the run stops with one error line: never a silent bf16 run.

The flow is imported lazily; polyfuse never needs neural_compressor otherwise. Exercised against a stand-in of
neural_compressor's API in tests/habana_double (the real one runs only inside Habana's container).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from polyfuse.core import settings


MISSING = (
    "QUANT_CONFIG={path}: Intel Neural Compressor's fp8 flow needs the neural_compressor package (Habana's container "
    "ships it; pip install neural-compressor-pt), which is not installed: nothing was measured or quantized"
)
NEEDS_GAUDI = (
    "QUANT_CONFIG={path}: Intel Neural Compressor's fp8 measurement and quantization run on a Gaudi (device hpu); "
    "this run is on {device}"
)


@dataclass
class IncRun:
    path: str
    measure: bool
    quantize: bool
    finalize: object  # neural_compressor.torch.quantization.finalize_calibration


def requested() -> Optional[str]:
    return settings.get("QUANT_CONFIG") or None


def refusal(device_type: str, other_quant: Optional[str] = None) -> Optional[str]:
    """Why QUANT_CONFIG cannot run here (one line), checked before the model loads; None when it can or is unset."""
    path = requested()
    if path is None:
        return None
    if device_type != "hpu":
        return NEEDS_GAUDI.format(path=path, device=device_type)
    if other_quant not in (None, "none"):
        return f"QUANT_CONFIG={path} with --quant {other_quant}: give one quantization (INC's fp8 quantizes itself)"
    try:
        import neural_compressor.torch.quantization  # noqa: F401
    except ImportError:
        return MISSING.format(path=path)
    import os

    if not os.path.isfile(path):
        return f"QUANT_CONFIG={path}: no such file"
    return None


def start(model) -> Optional[IncRun]:
    """Prepare (MEASURE) or convert (QUANTIZE) ``model`` in place with INC, as optimum-habana's setup_quantization;
    None without QUANT_CONFIG. ValueError (one line) where INC refuses the configuration."""
    path = requested()
    if path is None:
        return None
    try:
        from neural_compressor.torch.quantization import FP8Config, convert, finalize_calibration, prepare
    except ImportError:
        raise ValueError(MISSING.format(path=path)) from None
    try:
        config = FP8Config.from_json_file(path)
        if config.measure:
            prepare(model, config)
        if config.quantize:
            convert(model, config)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(
            f"QUANT_CONFIG={path}: Intel Neural Compressor refused it ({type(e).__name__}: {e})"
        ) from None
    model.steps = None  # graphs captured before hold the modules INC replaced
    return IncRun(path, bool(config.measure), bool(config.quantize), finalize_calibration)


def finish(run: Optional[IncRun], model) -> Optional[str]:
    """After the runs: in MEASURE mode write the measurement files (finalize_calibration); what was done, for the
    report."""
    if run is None:
        return None
    if run.measure:
        run.finalize(model)
        return f"QUANT_CONFIG={run.path}: measurements written (mode MEASURE)"
    return f"QUANT_CONFIG={run.path}: fp8 from the measurements (mode QUANTIZE)"
