"""FSDP2 through the Trainer on the CPU: 2 processes on gloo, launched with torchrun (docs/training.md, "FSDP2").

* tests/fsdp_worker.py under torchrun (one launch, three cases: polyfuse's Llama with SHARDED_STATE_DICT and with
  FULL_STATE_DICT checkpoints, a patched transformers Llama with SHARDED ones; gradient checkpointing on): each
  decoder layer is its own ``fully_shard`` unit, the fused linear cross-entropy runs once per step (the chunked loss,
  not the logits), the loss of every step equals the same run in one process (same global batch: 2 rows per rank
  against 4) within 1e-5 relative (fp32; measured: <= 2e-7), a run resumed from the step-2 checkpoint into a model
  built from other weights continues with the same losses and weights, and the final ``save_model`` writes one
  consolidated transformers checkpoint that transformers and polyfuse load, with the single-process run's weights
  (within (1e-4, 1e-5), the convergence test's tolerance) and greedy tokens;
* ``torchrun examples/run_clm.py`` on the built-in model (SmolLM2-135M, tied embeddings, 30 layers), polyfuse's
  Llama and the patched transformers Llama: losses equal the single-process run within
  1e-5 relative, rank 0 alone prints, the saved folder generates the single-process run's greedy tokens in
  transformers and in polyfuse;
* bad input: FSDP1 and CPU offload on a CPU run are one ``error:`` line; more processes than decoder layers, ranks
  given different arguments, a rank that never comes: one error line from rank 0, every rank exits non-zero by
  itself within seconds (bare processes, no launcher to stop the survivors).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsdp_worker
import pytest
import torch
from helpers import (  # noqa: F401  (one_thread: autouse fixture)
    dist_env,
    free_port,
    one_thread,
    run_session,
    run_workers,
    tiny_config,
    torchrun_cmd,
    write_tiny_cli_model,
)

from polyfuse.training.arguments import cpu_fsdp_unsupported


# CPU FSDP2 needs accelerate >= 1.15 (make test-compat's accelerate 1.10.1 refuses it with one error line, checked in
# test_cpu_fsdp_refused_with_old_accelerate).
pytestmark = pytest.mark.skipif(cpu_fsdp_unsupported() is not None, reason=str(cpu_fsdp_unsupported()))


ROOT = Path(__file__).resolve().parents[1]
RUN_CLM = str(ROOT / "examples" / "run_clm.py")
LOSS_RTOL = 1e-5
PARAM_TOL = {"atol": 1e-4, "rtol": 1e-5}


def _env(**extra) -> dict:
    return dist_env(**extra)


def _run(cmd, timeout: float, env=None) -> subprocess.CompletedProcess:
    return run_session(cmd, timeout, env or _env(), ROOT)


def _torchrun(*args, n: int = 2) -> list:
    return torchrun_cmd(*args, n=n)


def _free_port() -> int:
    return free_port()


def _error_lines(text: str) -> list:
    return [line for line in text.splitlines() if "error:" in line]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# -- in process: the pieces FSDP2 relies on ----------------------------------------------------------------------


def test_final_norm_and_head_run_through_module_calls():
    """FSDP2 unshards a unit's parameters in the pre-forward hook of its modules: the decoder's final norm and its
    fused loss must go through those modules' calls (hooks fire), with the loss unchanged."""
    from polyfuse.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_config(tiny_config(), training=True)
    fired = []
    for name in ("model.norm", "lm_head"):
        model.get_submodule(name).register_forward_pre_hook(lambda m, a, k, n=name: fired.append(n), with_kwargs=True)
    ids = torch.randint(10, 301, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(ids, labels=ids).loss
    assert fired == ["model.norm", "lm_head"]
    logits = model(ids).logits  # no labels: the head's plain projection
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    assert type(model)._no_split_modules == ["DecoderLayer"] and type(model).base_model_prefix == "model"


def test_patched_head_keeps_the_fused_loss_under_fsdp2_class():
    """fully_shard swaps a module's class for ``FSDP<Class>`` (FSDPModule + the original): the patched forward must
    still see a plain linear head (else the loss would go through the [tokens, vocab] logits)."""
    from torch.distributed.fsdp import FSDPModule

    from polyfuse.patch.hf import _lm_head_weight

    head = torch.nn.Linear(8, 16, bias=False)
    head.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    assert _lm_head_weight(head) is head.weight
    sub = type("Linear4bit", (torch.nn.Linear,), {})(8, 16, bias=False)  # a Linear subclass is not a plain head
    assert _lm_head_weight(sub) is None


def test_save_from_a_gathered_state_dict_equals_the_model_save(tmp_path):
    """What rank 0 writes from the full state dict FSDP2 gathers equals what ``save_pretrained`` writes from the
    parameters (fused projections split back, a tied head left out)."""
    from safetensors.torch import load_file

    from polyfuse.models.llama import LlamaForCausalLM
    from polyfuse.training.fsdp import parameters_of

    model = LlamaForCausalLM.from_config(tiny_config(tie_word_embeddings=True))
    model.save_pretrained(str(tmp_path / "a"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(str(tmp_path / "b"), params=parameters_of(model, state))
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "b"))
    assert sorted(a) == sorted(b) and "lm_head.weight" not in a and "model.layers.0.self_attn.q_proj.weight" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- 2 processes, FSDP2, against 1 process (tests/fsdp_worker.py) ------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    t0 = time.perf_counter()
    ranks = run_workers(ROOT / "tests" / "fsdp_worker.py", out, 600, _env(), ROOT)
    print(f"fsdp_worker launch: {time.perf_counter() - t0:.1f} s")
    return out, ranks


@pytest.fixture(scope="module")
def single_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    results = {}
    for case in ("polyfuse", "transformers"):
        results[case] = fsdp_worker.run_case(case, str(out), world=1)
    # the state dict type changes nothing in one process; the unsynced case's ranks train rank 0's weights (seed 0)
    results["polyfuse_full"] = results["polyfuse_unsynced"] = results["polyfuse"]
    folders = {case: out / fsdp_worker.CASES[case][0] / "final" for case in fsdp_worker.CASES}
    return results, folders


CASES = list(fsdp_worker.CASES)


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_each_decoder_layer_is_an_fsdp2_unit_and_the_fused_loss_runs(fsdp_results, single_results, case):
    _, ranks = fsdp_results
    r0 = ranks[0][case]
    assert r0["fsdp"], "accelerate did not run FSDP2"
    assert r0["layer_units"] == 2, r0["fsdp_units"]  # the tiny models' 2 decoder layers
    root = "FSDPLlamaForCausalLM"
    assert root in r0["fsdp_units"] and any("DecoderLayer" in u for u in r0["fsdp_units"]), r0["fsdp_units"]
    assert r0["fused_ce_calls"] == fsdp_worker.STEPS, "the loss did not go through the fused linear cross-entropy"
    single = single_results[0][case]
    assert r0["report"] == single["report"], "FSDP changed the kernels chosen"
    assert "linear_cross_entropy" in r0["report"]


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fsdp2_losses_equal_one_process(fsdp_results, single_results, case):
    _, ranks = fsdp_results
    losses, single = ranks[0][case]["losses"], single_results[0][case]["losses"]
    assert len(losses) == len(single) == fsdp_worker.STEPS
    worst = max(_rel(a, b) for a, b in zip(losses, single))
    print(f"{case}: FSDP2 x2 vs 1 process, worst relative loss difference {worst:.2e}")
    assert worst <= LOSS_RTOL, (losses, single)
    assert ranks[1][case]["losses"] == losses  # every rank logs the same (gathered) loss


@pytest.mark.slow
def test_ranks_starting_from_different_weights_train_rank_0s(fsdp_results):
    """FSDP2 shards each rank's own copy of the model: ranks whose trainable weights differ (the unsynced case: seed =
    rank, as a PEFT adapter drawn without a common seed) have them replaced by rank 0's before sharding: every tensor
    the seed draws (not the norms, which start at one), none where the ranks agree; the run then equals the one-process run from rank 0's weights
    (test_fsdp2_losses_equal_one_process, same case)."""
    _, ranks = fsdp_results
    for rank in ranks:
        unsynced = rank["polyfuse_unsynced"]
        assert unsynced["synced"] == [unsynced["seeded"]] and unsynced["seeded"] > 0, unsynced
        assert rank["polyfuse"]["synced"] == [0] and rank["transformers"]["synced"] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_resume_from_checkpoint_continues_the_run(fsdp_results, case):
    out, ranks = fsdp_results
    r0 = ranks[0][case]
    files = r0["checkpoint_files"]
    if fsdp_worker.CASES[case][1] == "SHARDED_STATE_DICT":
        assert "pytorch_model_fsdp_0" in files and "optimizer_0" in files, files  # DCP shards, for resuming
        assert "model.safetensors" not in files
    else:
        assert "model.safetensors" in files and "config.json" in files, files  # consolidated, transformers' format
    resumed = r0["resumed_losses"]
    assert len(resumed) == fsdp_worker.STEPS
    assert max(_rel(a, b) for a, b in zip(resumed[2:], r0["losses"][2:])) <= LOSS_RTOL, (resumed, r0["losses"])
    a, b = (_weights(out / name / "final") for name in (case, case + "_resumed"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], **PARAM_TOL, msg=k)


def _weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def _greedy(folder, loader: str, prompt: torch.Tensor) -> torch.Tensor:
    import transformers

    if loader == "polyfuse":
        from polyfuse.models import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(folder)).generate(prompt, max_new_tokens=8)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_consolidated_checkpoint_loads_in_transformers_and_polyfuse(fsdp_results, single_results, case):
    out, _ = fsdp_results
    folders = [out / case / "final", single_results[1][case]]
    if fsdp_worker.CASES[case][1] == "FULL_STATE_DICT":
        folders.append(out / case / "checkpoint-2")  # FULL_STATE_DICT checkpoints are consolidated too
    ours, ref = _weights(folders[0]), _weights(folders[1])
    assert sorted(ours) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], **PARAM_TOL, msg=k)
    prompt = torch.tensor([[11, 42, 7, 99, 23]])
    for loader in ("transformers", "polyfuse"):
        tokens = [_greedy(f, loader, prompt) for f in folders[:2]]
        assert torch.equal(tokens[0], tokens[1]), (loader, tokens)
    if len(folders) > 2:
        _greedy(folders[2], "transformers", prompt)


# -- run_clm.py under torchrun on the built-in model ---------------------------------------------------------------


def _builtin_or_skip():
    from polyfuse.models.builtin import builtin_model

    try:
        return builtin_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))


FSDP_CONFIG = {"fsdp_version": 2}
CLM = ["--max_steps", "5", "--block_size", "16", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm",
       "true", "--save_strategy", "no", "--learning_rate", "1e-4"]  # fmt: skip


@pytest.mark.parametrize(
    "impl",
    [
        "polyfuse",
        "transformers",
    ],
)
@pytest.mark.slow
def test_run_clm_fsdp2_on_the_builtin_model(tmp_path, impl):
    _builtin_or_skip()
    cfg = tmp_path / "fsdp2.json"
    cfg.write_text(json.dumps(FSDP_CONFIG))
    common = ["--model_impl", impl, *CLM]
    t0 = time.perf_counter()
    fsdp = _run(
        _torchrun(RUN_CLM, *common, "--per_device_train_batch_size", "1", "--output_dir", tmp_path / "fsdp",
                  "--fsdp", "full_shard auto_wrap", "--fsdp_config", cfg),
        timeout=900,
    )  # fmt: skip
    t1 = time.perf_counter()
    assert fsdp.returncode == 0, fsdp.stdout[-3000:] + fsdp.stderr[-5000:]
    single = _run(
        [sys.executable, RUN_CLM, *common, "--per_device_train_batch_size", "2", "--output_dir", tmp_path / "single"],
        timeout=900,
    )
    assert single.returncode == 0, single.stderr[-5000:]
    print(f"built-in {impl}: FSDP2 x2 run {t1 - t0:.0f} s, one process {time.perf_counter() - t1:.0f} s")
    assert fsdp.stdout.count("saved to") == 1 and fsdp.stdout.count("polyfuse backends") == 1  # rank 0 alone
    logs = [json.loads((tmp_path / d / "trainer_state.json").read_text())["log_history"] for d in ("fsdp", "single")]
    losses = [[h["loss"] for h in log if "loss" in h] for log in logs]
    assert len(losses[0]) == len(losses[1]) == 5
    worst = max(_rel(a, b) for a, b in zip(*losses))
    print(f"built-in {impl}: losses {losses[0]} vs {losses[1]}, worst relative difference {worst:.2e}")
    assert worst <= LOSS_RTOL
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "single"))
    prompt = torch.tensor([tok("The capital of France is")["input_ids"]])
    for loader in ("polyfuse", "transformers"):
        a, b = (_greedy(tmp_path / d, loader, prompt) for d in ("fsdp", "single"))
        assert torch.equal(a, b), (loader, a, b)


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_clm():
    spec = importlib.util.spec_from_file_location("run_clm_fsdp_under_test", RUN_CLM)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize(
    "config, extra, message",
    [
        ({"fsdp_version": 1}, [], "polyfuse trains with FSDP2 only; fsdp_config asks for version 1"),
        ({"fsdp_version": 2, "cpu_offload": True}, [], "this run trains on the CPU, where the parameters already are"),
        ({"fsdp_version": 2}, ["--fsdp", "full_shard offload"], "this run trains on the CPU"),
    ],
)
def test_fsdp_options_polyfuse_refuses_are_one_error_line(run_clm, tmp_path, capsys, config, extra, message):
    cfg = tmp_path / "fsdp.json"
    cfg.write_text(json.dumps(config))
    argv = ["--output_dir", str(tmp_path / "out"), "--fsdp_config", str(cfg), *(extra or ["--fsdp", "full_shard"])]
    with pytest.raises(SystemExit) as e:
        run_clm.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert _error_lines(err) == [line for line in err.splitlines() if line.startswith("run_clm.py: error:")]
    assert len(_error_lines(err)) == 1 and message in err, err


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory):
    from polyfuse.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(*_builtin_or_skip())
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("two_layers")), tokenizer, max_position_embeddings=64)


def _bare_ranks(world: int, argv_for_rank, timeout: float = 180, ranks=None):
    """``world``-rank environment for each process in ``ranks`` (default: all), started without a launcher; returns
    [(returncode, stdout, stderr, seconds)]."""
    port = _free_port()
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, RUN_CLM, *argv_for_rank(r)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=_env(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            ),
        )  # fmt: skip
        for r in (ranks if ranks is not None else range(world))
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err, time.perf_counter() - t0))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return results


def _clm_args(model: str, out: Path, *extra) -> list:
    return ["--model_name_or_path", model, "--output_dir", str(out), "--max_steps", "2", "--block_size", "16",
            "--report_to", "none", "--disable_tqdm", "true", "--ddp_timeout", "60", *map(str, extra)]  # fmt: skip


def _assert_one_error_from_rank0(results, code: int, message: str):
    codes = [r[0] for r in results]
    assert codes == [code] * len(results), (codes, [r[2][-2000:] for r in results])
    err0 = results[0][2]
    assert len(_error_lines(err0)) == 1 and message in err0, err0
    assert "Traceback" not in err0, err0
    for _, out, err, _ in results[1:]:
        assert out == "" and err == "", err  # the other ranks say nothing
    ends = [r[3] for r in results]
    assert max(ends) - min(ends) < 20, f"ranks ended {max(ends) - min(ends):.1f} s apart"
    return max(ends)


@pytest.mark.slow
def test_more_processes_than_layers_one_error_line(two_layer_model, tmp_path):
    cfg = tmp_path / "fsdp2.json"
    cfg.write_text(json.dumps(FSDP_CONFIG))
    fsdp = ["--fsdp", "full_shard auto_wrap", "--fsdp_config", cfg]
    results = _bare_ranks(3, lambda r: _clm_args(two_layer_model, tmp_path / "out", *fsdp))
    seconds = _assert_one_error_from_rank0(results, 2, "3 processes but the model has 2 decoder layer(s) to shard")
    print(f"3 ranks, 2 layers: every rank exited 2 after {seconds:.1f} s")


@pytest.mark.slow
def test_ranks_given_different_arguments_one_error_line(two_layer_model, tmp_path):
    results = _bare_ranks(2, lambda r: _clm_args(two_layer_model, tmp_path / "out", "--learning_rate", 1e-4 * (r + 1)))
    _assert_one_error_from_rank0(results, 2, "ranks disagree on the model: rank 0 loaded")


@pytest.mark.slow
def test_a_rank_that_never_comes_one_error_line(two_layer_model, tmp_path):
    """Rank 1 of 2 is never started: rank 0 waits --ddp_timeout (5 s here) for it, then says so and exits."""
    results = _bare_ranks(
        2, lambda r: [*_clm_args(two_layer_model, tmp_path / "out"), "--ddp_timeout", "5"], ranks=[0]
    )
    code, out, err, seconds = results[0]
    assert code == 1 and len(_error_lines(err)) == 1, err
    assert "the ranks did not all join within --ddp_timeout 5 s" in err and "1/2 clients joined" in err, err
    assert seconds < 90, seconds


# -- Gaudi (the habana_frameworks test double): what PolyfuseTrainer does differently under FSDP2 ----------------


@pytest.fixture
def habana_double(monkeypatch):
    from test_hpu_backend import _forget_habana, _import_double

    double = _import_double(monkeypatch, None)
    import habana_frameworks.torch  # noqa: F401  (the double's hpu device)

    yield double
    _forget_habana()


def test_gaudi_fused_adamw_and_clip_norm_stay_off_under_fsdp2(habana_double, monkeypatch, tmp_path):
    """GaudiTrainer-style ``use_fused_adam`` / ``use_fused_clip_norm``: under FSDP2 the parameters are DTensors
    (each rank's shard), so PolyfuseTrainer uses torch's AdamW and accelerate's clip (which reduces the norm over the
    ranks; FusedClipNorm's would be the shard's). Without FSDP the same trainer takes Habana's (control)."""
    from test_hpu_backend import _LoraLike

    from polyfuse.backends.hpu.runtime import HpuRuntime
    from polyfuse.training import GaudiConfig, PolyfuseTrainer, PolyfuseTrainingArguments, arguments

    monkeypatch.setattr(arguments, "hpu_available", lambda: True)
    for fsdp in (True, False):
        args = PolyfuseTrainingArguments(output_dir=str(tmp_path), use_habana=True, report_to=[], use_cpu=True)
        gaudi = GaudiConfig(use_fused_adam=True, use_fused_clip_norm=True)
        trainer = PolyfuseTrainer(_LoraLike(), args, gaudi_config=gaudi)
        trainer.model.to("hpu")  # the Trainer runs on the CPU here; the model and the runtime are Gaudi's
        trainer.runtime = HpuRuntime(torch.device("hpu"))
        trainer.is_fsdp_enabled = fsdp  # what the Trainer sets once accelerate runs FSDP2
        opt = trainer.create_optimizer()
        habana = type(opt).__module__ == "habana_frameworks.torch.hpex.optimizers"
        assert habana is not fsdp, type(opt)
        params = list(trainer.model.parameters())
        for p in params:
            p.grad = torch.ones_like(p)
        assert (trainer._fused_clip_grad_norm(params) is None) is fsdp


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="DeepSpeed is installed here")
def test_deepspeed_without_the_package_is_one_error_line(run_clm, tmp_path, capsys):
    """``--deepspeed config.json`` goes to transformers' DeepSpeed integration (ZeRO-3 as GaudiTrainer runs it); where
    DeepSpeed is not installed that is one line, not transformers' PackageNotFoundError traceback."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}))
    with pytest.raises(SystemExit) as e:
        run_clm.parse_args(["--output_dir", str(tmp_path / "out"), "--deepspeed", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(_error_lines(err)) == 1 and "--deepspeed needs DeepSpeed: pip install deepspeed" in err, err


# -- the FSDP2 benchmark's CPU smoke test -------------------------------------------------------------------------


@pytest.mark.slow
def test_benchmark_fsdp_tiny_under_torchrun(tmp_path):
    """benchmarks/benchmark_fsdp.py --shape tiny: both Trainers run FSDP2 on 2 gloo processes, rank 0 prints one line
    per case and the ratio, and the JSON has both cases (the GPU run: docs/training.md, "FSDP2")."""
    out = tmp_path / "bench.json"
    p = _run(_torchrun(ROOT / "benchmarks" / "benchmark_fsdp.py", "--shape", "tiny", "--steps", "2", "--warmup", "1",
                       "--output", out), timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [c["variant"] for c in res["cases"]] == ["transformers", "polyfuse"]
    for c in res["cases"]:
        assert c["fsdp2"] and c["tokens_per_s_per_gpu"] > 0, c
    assert res["fsdp"]["fsdp_config"]["fsdp_version"] == 2
    assert "tokens_per_s_ratio" in res["summary"]
    assert p.stdout.count("tokens/s per GPU (") == 2 and "ratio polyfuse/transformers" in p.stdout, p.stdout


# -- convergence over 200 steps (issue 13, item 5's FSDP part) ------------------------------------------------------

TINY_OVERRIDES = "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2"


@pytest.mark.slow  # 200 training steps twice (tiny: ~1 min; built-in: ~15 min)
@pytest.mark.parametrize("model", ["tiny", "builtin"])
def test_run_clm_200_steps_reach_the_same_loss_with_and_without_fsdp2(tmp_path, model):
    """200 steps of run_clm.py (polyfuse's Llama), FSDP2 over 2 processes against one process with the same global
    batch: the mean of the last 10 logged losses within 2%. ``tiny``: random weights from the built-in model's config
    made small (lr 1e-3); ``builtin``: SmolLM2-135M itself (lr 1e-5)."""
    _builtin_or_skip()
    cfg = tmp_path / "fsdp2.json"
    cfg.write_text(json.dumps(FSDP_CONFIG))
    extra = ["--config_overrides", TINY_OVERRIDES, "--learning_rate", "1e-3"] if model == "tiny" else []
    common = ["--model_impl", "polyfuse", "--max_steps", "200", "--block_size", "16", "--logging_steps", "1",
              "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--learning_rate", "1e-5",
              *extra]  # fmt: skip
    runs = {
        "fsdp": _torchrun(RUN_CLM, *common, "--per_device_train_batch_size", "1", "--output_dir", tmp_path / "fsdp",
                          "--fsdp", "full_shard auto_wrap", "--fsdp_config", cfg),
        "single": [sys.executable, RUN_CLM, *common, "--per_device_train_batch_size", "2", "--output_dir",
                   tmp_path / "single"],
    }  # fmt: skip
    tails = {}
    for name, cmd in runs.items():
        t0 = time.perf_counter()
        p = _run(cmd, timeout=3600)
        assert p.returncode == 0, p.stderr[-5000:]
        log = json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
        losses = [h["loss"] for h in log if "loss" in h]
        assert len(losses) == 200
        tails[name] = sum(losses[-10:]) / 10
        print(f"{model} {name}: first loss {losses[0]:.6f}, mean of the last 10 {tails[name]:.6f}, "
              f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    print(f"{model}: relative difference of the means {_rel(tails['fsdp'], tails['single']):.2e}")
    assert _rel(tails["fsdp"], tails["single"]) <= 0.02, tails
