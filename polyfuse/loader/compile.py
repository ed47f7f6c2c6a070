"""--torch_compile, with optimum-habana's --regional_compile and --force_static_compile, as the device's runtime
says (--cache_size_limit and dynamo's other settings are set by the CLI, cli/habana_options.py):

* where the runtime ``compiles_decoder`` (Gaudi), as optimum-habana's ``get_torch_compiled_model``: the whole
  decoder, embedding to final norm, compiled with the runtime's backend (``hpu_backend``) and its options
  (``force_static_compile``, ``keep_input_mutations``); with --regional_compile each decoder layer instead;
* elsewhere: the ops that run their native reference, each compiled on its own (``Kernels.compiled``), unless
  --regional_compile asks for each decoder layer, compiled with the runtime's backend (inductor) where layers
  compile with it (``runtime.compiles_layers``: not on CUDA, whose layers launch Triton kernels; there one warning,
  and the ops).

--force_static_compile compiles with ``dynamic=False``: a graph per shape, never one with symbolic sizes. Training
compiles the ops (the decoder's activation checkpointing and the trainer wrap the layers themselves).
"""

from __future__ import annotations

import logging

import torch


logger = logging.getLogger("polyfuse")


def compile_for_run(model, flags: dict, training: bool = False) -> None:
    """Compile ``model`` for a run with --torch_compile (``flags``), in place."""
    runtime = model.runtime
    backend = runtime.compile_backend()
    regional, static = bool(flags.get("regional_compile")), bool(flags.get("force_static_compile"))
    dynamic = False if static else None
    decoder = (runtime.compiles_decoder or regional) and not training
    if decoder and not runtime.compiles_layers:
        logger.warning(
            "warning: --regional_compile on %s: its decoder layers launch kernels %s does not trace; the "
            "ops that run their native reference are compiled instead",
            runtime.device.type,
            backend,
        )
        decoder = False
    if not decoder:
        model.kernels = model.kernels.compiled(backend, dynamic=dynamic)
        return
    model.kernels.resolve_imports()
    kwargs = {"backend": backend, "dynamic": dynamic}
    options = runtime.compile_options(static)
    if options:
        kwargs["options"] = options
    model.compile_decoder(lambda fn: torch.compile(fn, **kwargs), regional=regional)
