"""optimum-habana 1.21's run_generation.py command lines run unchanged: its argparse definitions (read from its
source with ast into tests/data, with the source URL: the 1.21.2 wheel ships no examples) against polyfuse's
parser, docs/hpu.md's table, and every command line of its text-generation README (model swapped for the built-in
one) either running on the CPU or stopping with one ``error:`` line."""

import json
import re
from pathlib import Path

import pytest

from polyfuse.cli.args import build_parser
from polyfuse.cli.habana_options import HABANA_FLAGS, apply_habana_options


DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent
ARGS = json.loads((DATA / "optimum_habana_1.21_run_generation_args.json").read_text())["arguments"]
README = json.loads((DATA / "optimum_habana_1.21_text_generation_readme.json").read_text())["lines"]
# Defaults polyfuse keeps on purpose (docs/hpu.md says why): the device is picked, the model has a built-in default,
# the bucket size is device-dependent (-1 on hpu, as optimum-habana's), fast softmax follows the device.
OWN_DEFAULTS = {"--device", "--model_name_or_path", "--bucket_size"}


def _actions():
    p = build_parser()
    return p, {s: a for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("arg", ARGS, ids=[a["flags"][0] for a in ARGS])
def test_every_flag_with_its_spelling_default_and_values(arg):
    """Each flag exists (every alias), with optimum-habana's default, and takes the values optimum-habana's does:
    an explicit True / False where its action is SetTrueOrFalseOrNone, a --no- form for BooleanOptionalAction."""
    p, actions = _actions()
    flag = arg["flags"][0]
    for alias in arg["flags"]:
        assert alias in actions, alias
    act = actions[flag]
    if flag not in OWN_DEFAULTS and "default" in arg:
        assert act.default == arg["default"], (flag, act.default, arg["default"])
    if "choices" in arg and flag != "--device":
        assert list(act.choices) == list(arg["choices"]), flag
    if arg.get("action") == "SetTrueOrFalseOrNone":
        for text, want in (("True", True), ("false", False)):
            assert getattr(p.parse_args([flag, text]), act.dest) is want, flag
        assert getattr(p.parse_args([flag]), act.dest) in (True, None), flag
    if arg.get("action") == "argparse.BooleanOptionalAction":
        assert getattr(p.parse_args(["--no-" + flag[2:]]), act.dest) is False


def test_ignore_eos_defaults_true_as_optimum_habana():
    assert build_parser().parse_args([]).ignore_eos is True


def test_docs_table_names_every_flag_with_its_status():
    """docs/hpu.md has one row per optimum-habana flag: implemented, warned or refused, as the code classifies it."""
    text = (ROOT / "docs" / "hpu.md").read_text()
    rows = dict(re.findall(r"^\| `(--[\w-]+)`[^|]*\| (implemented|warned|refused) \|", text, re.M))
    for arg in ARGS:
        flag = arg["flags"][0]
        assert flag in rows, f"{flag} missing from docs/hpu.md's flag table"
        if flag in HABANA_FLAGS:
            assert rows[flag] == HABANA_FLAGS[flag][0], flag


@pytest.mark.parametrize("line", README, ids=[str(i) for i in range(len(README))])
def test_readme_line_parses_and_runs_or_stops_in_one_line(line):
    """None is refused by the parser; each is either accepted (warnings for what changes nothing) or stopped by one
    error line naming the flag; a QUANT_CONFIG line on the CPU says INC needs a Gaudi (never a silent bf16 run)."""
    from polyfuse.quant import inc

    args = build_parser().parse_args(line["args"])  # SystemExit (the parser's refusal) fails the test
    try:
        warnings = apply_habana_options(args)
    except ValueError as e:
        assert "\n" not in str(e) and str(e).startswith("--"), e
        return
    assert all("\n" not in w for w in warnings)
    if "QUANT_CONFIG" in line["env"]:
        import os

        old = os.environ.get("QUANT_CONFIG")
        os.environ["QUANT_CONFIG"] = line["env"]["QUANT_CONFIG"]
        try:
            assert "Gaudi" in inc.refusal("cpu")
        finally:
            os.environ.pop("QUANT_CONFIG") if old is None else os.environ.__setitem__("QUANT_CONFIG", old)


def _accepted_lines():
    """README lines the flags accept (the rest stop in one error line, checked above), without QUANT_CONFIG."""
    out = []
    for i, line in enumerate(README):
        args = build_parser().parse_args(line["args"])
        try:
            apply_habana_options(args)
        except ValueError:
            continue
        if "QUANT_CONFIG" not in line["env"]:
            out.append(pytest.param(line, id=str(i)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("line", _accepted_lines())
def test_readme_lines_run_on_the_cpu(line, capsys):
    """Accepted README lines run on the CPU with the built-in model, scaled down (2 new tokens, one run, batch 1;
    later flags win): exit 0 with the Stats, or (a Hub model that is not in the offline cache, such as an assistant
    model) one error line naming it."""
    from polyfuse.cli.generate import main

    small = ["--max_new_tokens", "2", "--warmup", "0", "--n_iterations", "1", "--batch_size", "1", "--device", "cpu"]
    if "--max_input_tokens" in line["args"]:
        small += ["--max_input_tokens", "16"]
    rc = main([*line["args"], *small])
    out, err = capsys.readouterr()
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    if rc == 0:
        assert "Stats:" in out and not errors
    else:
        assert len(errors) == 1 and "Stats:" not in out, err


def test_bare_use_lazy_mode_parses_as_in_the_language_modeling_readme():
    """optimum-habana's run_clm lines give ``--use_lazy_mode`` with no value (15 of its 17 README lines)."""
    from transformers import HfArgumentParser

    from polyfuse.training import PolyfuseTrainingArguments

    p = HfArgumentParser(PolyfuseTrainingArguments)
    assert p.parse_args(["--output_dir", "o", "--use_lazy_mode"]).use_lazy_mode is True
    assert p.parse_args(["--output_dir", "o", "--use_lazy_mode", "false"]).use_lazy_mode is False
    assert p.parse_args(["--output_dir", "o"]).use_lazy_mode is None
