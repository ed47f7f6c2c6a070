"""No polyfuse checkpoint loads into transformers as wrong weights: a save in polyfuse's own quantized format
(``quant_method: "polyfuse"``: int8, fp8, kept GGUF blocks) is refused by transformers' ``from_pretrained`` with
polyfuse imported (its registered quantizer, one line naming how to load it) and without (the empty ``.weight``
placeholders: a size mismatch); polyfuse reads the same folder back as stored."""

import os
import subprocess
import sys

import pytest
import torch
import transformers
from helpers import one_thread, perturb_, tiny_config  # noqa: F401

from polyfuse.models import AutoModelForCausalLM as PfAuto


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.manual_seed(0)
    float_dir = tmp_path_factory.mktemp("float")
    perturb_(transformers.LlamaForCausalLM(tiny_config(num_key_value_heads=2)).float()).save_pretrained(float_dir)
    out = {"float": str(float_dir)}
    for fmt in ("int8", "fp8"):
        path = tmp_path_factory.mktemp(fmt)
        PfAuto.from_pretrained(str(float_dir), quant=fmt).save_pretrained(path)
        out[fmt] = str(path)
    return out


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_transformers_with_polyfuse_refuses_in_one_line(folders, fmt):
    with pytest.raises(ValueError, match=f"packed by polyfuse \\({fmt}\\).*polyfuse.AutoModelForCausalLM") as e:
        transformers.AutoModelForCausalLM.from_pretrained(folders[fmt])
    assert "\n" not in str(e.value)
    ids = torch.tensor([[3, 40, 41, 42, 43]])
    again = PfAuto.from_pretrained(folders[fmt])  # polyfuse: as stored, the same logits as the model saved
    with torch.no_grad():
        want = PfAuto.from_pretrained(folders["float"], quant=fmt)(ids).logits
        assert torch.equal(again(ids).logits, want)


def test_transformers_without_polyfuse_refuses(folders):
    code = (
        "import sys, transformers\n"
        "assert not any(m.startswith('polyfuse') for m in sys.modules)\n"
        f"try:\n    transformers.AutoModelForCausalLM.from_pretrained({folders['int8']!r})\n"
        "except (RuntimeError, ValueError) as e:\n    print('refused:', type(e).__name__)\nelse:\n    print('loaded')\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("refused"), done.stdout
