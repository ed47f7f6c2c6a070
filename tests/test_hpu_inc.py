"""``QUANT_CONFIG``: Intel Neural Compressor's fp8 flow as optimum-habana's run_generation.py runs it (measure, then
quantize from the measurements), through examples/run_generation.py's entry point, on the TEST DOUBLE of
habana_frameworks and a STAND-IN of neural_compressor's API (tests/habana_double/neural_compressor: the real package
runs only with Habana's bridge and was not installed here). Nothing here has run on a Gaudi."""

import json
import sys

import pytest
from helpers import one_thread, write_tiny_cli_model  # noqa: F401  (one_thread: autouse fixture)
from test_hpu_backend import _forget_habana, _import_double

from polyfuse.cli.generate import main


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        tokenizer = load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("tiny_inc")), tokenizer, max_position_embeddings=64)


@pytest.fixture
def gaudi(monkeypatch):
    """The double in lazy mode: `--device hpu` finds a Gaudi."""
    from polyfuse.core import platform

    double = _import_double(monkeypatch, True)
    platform.hpu_available.cache_clear()
    yield double
    _forget_habana()
    platform.hpu_available.cache_clear()
    for name in [n for n in sys.modules if n.startswith("neural_compressor")]:
        del sys.modules[name]


def _config(tmp_path, mode):
    path = tmp_path / f"maxabs_{mode.lower()}.json"
    dump = tmp_path / "hqt_output" / "measure"
    path.write_text(json.dumps({"method": "HOOKS", "mode": mode, "observer": "maxabs", "scale_method": "maxabs_hw",
                                "dump_stats_path": str(dump)}))  # fmt: skip
    return path, dump


def _run(folder, capsys, device="hpu", extra=()):
    argv = ["--model_name_or_path", folder, "--device", device, "--bf16", "--use_kv_cache", "--max_new_tokens", "4",
            "--warmup", "0", "--n_iterations", "1", "--prompt", "Hello there", *extra]  # fmt: skip
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_measure_then_quantize_writes_and_reads_the_files(gaudi, tiny_folder, tmp_path, monkeypatch, capsys):
    """MEASURE: INC patches the projections, the runs go through them, and the measurement files are written.
    QUANTIZE: they are read back and every projection runs Habana's fp8 GEMM in INC's form (trans_B=False)."""
    measure, dump = _config(tmp_path, "MEASURE")
    monkeypatch.setenv("QUANT_CONFIG", str(measure))
    rc, out, err = _run(tiny_folder, capsys)
    assert rc == 0, err
    stats = json.loads((tmp_path / "hqt_output" / "measure_hooks_maxabs.json").read_text())["Nodes"]
    assert (tmp_path / "hqt_output" / "measure_hooks_maxabs_mod_list.json").is_file()
    assert len(stats) == 2 * 4 and all(v["inputs"][0] > 0 for v in stats.values())  # qkv, o, gate_up, down per layer
    assert "measurements written" in err
    gaudi.reset()
    quantize, _ = _config(tmp_path, "QUANTIZE")
    monkeypatch.setenv("QUANT_CONFIG", str(quantize))
    rc, out, err = _run(tiny_folder, capsys)
    assert rc == 0, err
    assert gaudi.calls("inc.convert") and len(gaudi.calls("inc.convert")[0][0]) == 2
    gemms = gaudi.calls("fp8_gemm_v2")
    assert gemms and all(a[3] is False and a[1] is False for a, _ in gemms)
    assert "Stats:" in out


def test_quantize_without_measurements_is_one_error_line(gaudi, tiny_folder, tmp_path, monkeypatch, capsys):
    quantize, _ = _config(tmp_path, "QUANTIZE")
    monkeypatch.setenv("QUANT_CONFIG", str(quantize))
    rc, out, err = _run(tiny_folder, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and lines[-1].startswith("error: QUANT_CONFIG=") and "measurement file" in lines[-1]
    assert sum(line.startswith("error:") for line in lines) == 1


def test_without_neural_compressor_one_error_line_not_a_bf16_run(gaudi, tiny_folder, tmp_path, monkeypatch, capsys):
    measure, dump = _config(tmp_path, "MEASURE")
    monkeypatch.setenv("QUANT_CONFIG", str(measure))
    monkeypatch.setitem(sys.modules, "neural_compressor", None)
    rc, out, err = _run(tiny_folder, capsys)
    assert rc == 2 and "Stats:" not in out
    (line,) = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert "neural_compressor" in line and not (tmp_path / "hqt_output").exists()


def test_quant_config_on_the_cpu_says_it_needs_a_gaudi(tiny_folder, tmp_path, monkeypatch, capsys):
    measure, _ = _config(tmp_path, "MEASURE")
    monkeypatch.setenv("QUANT_CONFIG", str(measure))
    rc, out, err = _run(tiny_folder, capsys, device="cpu")
    assert rc == 2 and "Stats:" not in out
    (line,) = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert "Gaudi" in line and "cpu" in line
