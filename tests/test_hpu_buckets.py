"""optimum-habana's static-shape flags end to end on Gaudi, against the TEST DOUBLE in lazy mode (which compiles a
graph per new signature and counts them): --bucket_size with --reduce_recompile and a warm-up of every prompt
bucket (--simulate_dyn_prompt, --dataset_name with prompts of varied lengths) leave nothing to compile in the timed
runs, and the outputs are the CPU run's. Nothing here has run on a Gaudi."""

import json

import pytest
from helpers import one_thread, write_tiny_cli_model  # noqa: F401  (one_thread: autouse fixture)
from test_hpu_inc import gaudi, tiny_folder  # noqa: F401  (fixtures: the double with --device hpu, a tiny model)

from polyfuse.cli.generate import main


PROMPT = "The capital of France is a city that"
TEXTS = [
    "One two three",
    "The river runs past the old mill and on towards the sea where boats wait",
    "Cats sleep most of the day and",
    "Seven",
    "Every morning the baker opens the shop",
]


@pytest.fixture
def compilations_after_warmup(gaudi, monkeypatch):  # noqa: F811
    """[compilations when the warm-up ended]: the CLI resets the peak memory right after its warm-up."""
    from habana_frameworks.torch.hpu.metrics import metric_global

    from polyfuse.backends.hpu.runtime import HpuRuntime

    seen = []
    reset = HpuRuntime.reset_peak_memory

    def snapshot(self):
        seen.append(dict(metric_global("graph_compilation").stats())["TotalNumber"])
        return reset(self)

    monkeypatch.setattr(HpuRuntime, "reset_peak_memory", snapshot)
    return seen


def _compilations() -> int:
    from habana_frameworks.torch.hpu.metrics import metric_global

    return dict(metric_global("graph_compilation").stats())["TotalNumber"]


def _run(capsys, folder, out, device, *extra):
    rc = main(["--model_name_or_path", folder, "--device", device, "--use_kv_cache", "--max_new_tokens", "12",
               "--bucket_size", "8", "--output_dir", str(out), *extra])  # fmt: skip
    text, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads((out / "results.json").read_text()), text


def test_dyn_prompt_buckets_warmed_up_compile_nothing_after(capsys, tiny_folder, tmp_path, compilations_after_warmup):  # noqa: F811
    """--simulate_dyn_prompt 5 11 3 14 --bucket_size 8 --reduce_recompile: the warm-up runs the buckets 16 and 8
    (twice: --warmup 2), the four timed runs (prompt widths 5, 11, 3, 14) compile nothing, and the last run's
    tokens are the CPU's."""
    extra = ("--prompt", PROMPT, "--simulate_dyn_prompt", "5", "11", "3", "14", "--reduce_recompile", "--warmup",
             "2", "--n_iterations", "4")  # fmt: skip
    got, out = _run(capsys, tiny_folder, tmp_path / "hpu", "hpu", *extra)
    assert compilations_after_warmup and _compilations() == compilations_after_warmup[0], "compiled while timed"
    assert out.index("Warming up for shape 15 iteration 1/2") < out.index("Warming up for shape 7 iteration 1/2")
    want, _ = _run(capsys, tiny_folder, tmp_path / "cpu", "cpu", *extra)
    assert got["output"] == want["output"]


def test_dataset_prompt_buckets_warmed_up_compile_nothing_after(capsys, tiny_folder, tmp_path,  # noqa: F811
                                                               compilations_after_warmup):  # fmt: skip
    """A data set of prompts of varied lengths (--max_input_tokens -1), batches of 2 (the last one filled up on the
    device): the warm-up runs a batch of every prompt bucket, the timed pass compiles nothing, the outputs are the
    CPU run's."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    extra = ("--dataset_name", str(data), "--max_input_tokens", "-1", "--batch_size", "2", "--reduce_recompile",
             "--warmup", "2")  # fmt: skip
    got, out = _run(capsys, tiny_folder, tmp_path / "hpu", "hpu", *extra)
    assert compilations_after_warmup and _compilations() == compilations_after_warmup[0], "compiled while timed"
    assert "Batch n°3" in out and len(got["output"]) == len(TEXTS)
    want, _ = _run(capsys, tiny_folder, tmp_path / "cpu", "cpu", *extra)
    assert got["output"] == want["output"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (("--bucket_internal", "--bucket_size", "8"), "--bucket_internal buckets the KV cache"),
        (("--bucket_internal", "--use_kv_cache", "--bucket_size", "-1"), "--bucket_size >= 0"),
        (("--reduce_recompile",), "--reduce_recompile needs --bucket_size > 0"),
    ],
    ids=["no-kv-cache", "no-buckets", "reduce-without-buckets"],
)
def test_bucket_flags_as_optimum_habana_asserts(capsys, tiny_folder, extra, needle):  # noqa: F811
    rc = main(["--model_name_or_path", tiny_folder, "--device", "cpu", "--max_new_tokens", "2", "--warmup", "0",
               "--n_iterations", "1", "--bucket_size", "-1", *extra])  # fmt: skip
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc != 0 and len(errors) == 1 and needle in errors[0], err
