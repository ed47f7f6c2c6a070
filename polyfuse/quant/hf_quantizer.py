"""polyfuse's quantized format (``quantization_config.quant_method: "polyfuse"``) in transformers' quantizer
registry, so that a polyfuse-quantized folder never loads into a transformers model as random projections.

Without polyfuse, transformers skips an unknown ``quant_method`` with a warning; the empty ``.weight`` a polyfuse
save writes beside every packed projection (quantize.py ``refusal_placeholders``) then makes it refuse the folder
(a size mismatch, 4.55 and 5.x). With polyfuse imported, this quantizer refuses it earlier with one line naming
the way to load it: polyfuse's own model classes (transformers ``PreTrainedModel`` s, which run the packed weights)
or a float copy. transformers' own classes have no kernels for polyfuse's packed formats.
"""

from __future__ import annotations


QUANT_METHOD = "polyfuse"
_registered = False


def register() -> None:
    """Register the config and quantizer for ``quant_method: "polyfuse"`` (once per process)."""
    global _registered
    if _registered:
        return
    from transformers.quantizers import HfQuantizer
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class PolyfuseQuantConfig(QuantizationConfigMixin):
        """config.json's ``quantization_config`` of a polyfuse save: the format of every packed projection."""

        def __init__(self, formats=None, group_sizes=None, version=1, **kwargs):
            self.quant_method = QUANT_METHOD
            self.formats, self.group_sizes, self.version = dict(formats or {}), dict(group_sizes or {}), version

    class PolyfuseHfQuantizer(HfQuantizer):
        requires_calibration = True  # only pre-quantized folders: transformers cannot quantize to these formats

        def validate_environment(self, *args, **kwargs):
            kinds = sorted(set(self.quantization_config.formats.values())) or ["packed"]
            raise ValueError(
                f"this checkpoint holds weights packed by polyfuse ({', '.join(kinds)}), which transformers' own "
                "model classes cannot run: load it with polyfuse.AutoModelForCausalLM.from_pretrained(path) (a "
                "transformers PreTrainedModel), or save a float copy with from_pretrained(path, quant='none')"
            )

        def _process_model_before_weight_loading(self, model, **kwargs):
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            return model

        def is_serializable(self, *args, **kwargs):
            return False

        @property
        def is_trainable(self):
            return False

    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(PolyfuseQuantConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(PolyfuseHfQuantizer)
    _registered = True
