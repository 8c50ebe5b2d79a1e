"""The ``memfit`` command line: JSON and table output, count suffixes, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.units import format_bytes

SRC = Path(__file__).resolve().parents[1] / "src"

SEED_ARGS = [
    "estimate",
    "--params",
    "20000000",
    "--batch-size",
    "32",
    "--activations-per-sample",
    "1000000",
    "--precision",
    "fp32",
    "--optimizer",
    "none",
]


def _run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return json.loads(captured.out)


def test_json_seed_example(capsys: pytest.CaptureFixture[str]) -> None:
    data = _run_json(capsys, *SEED_ARGS)
    assert data["total_bytes"] == 288_000_000
    assert data["parameters_bytes"] == 80_000_000
    assert data["gradients_bytes"] == 80_000_000
    assert data["master_weights_bytes"] == 0
    assert data["optimizer_state_bytes"] == 0
    assert data["activations_bytes"] == 128_000_000
    assert data["precision"] == "fp32"
    assert data["optimizer"] == "none"
    component_keys = [k for k in data if k.endswith("_bytes") and k != "total_bytes"]
    assert component_keys == [
        "parameters_bytes",
        "gradients_bytes",
        "master_weights_bytes",
        "optimizer_state_bytes",
        "activations_bytes",
    ]
    assert sum(data[k] for k in component_keys) == data["total_bytes"]


def test_json_sgd_momentum_seed(capsys: pytest.CaptureFixture[str]) -> None:
    data = _run_json(capsys, "estimate", "--params", "19072984", "--optimizer", "sgd-momentum")
    assert data["total_bytes"] == 228_875_808


def test_json_mixed_precision_adam_seed(capsys: pytest.CaptureFixture[str]) -> None:
    data = _run_json(capsys, "estimate", "--params", "7e9", "--precision", "16-mixed", "--optimizer", "adam")
    assert data["parameters_bytes"] == 14 * 10**9
    assert data["optimizer_state_bytes"] == 56 * 10**9
    assert data["total_bytes"] == 112 * 10**9


def test_defaults_are_fp32_adamw(capsys: pytest.CaptureFixture[str]) -> None:
    data = _run_json(capsys, "estimate", "--params", "1000")
    assert data["precision"] == "fp32"
    assert data["optimizer"] == "adamw"
    assert data["batch_size"] == 1
    assert data["total_bytes"] == 1000 * 16


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SEED_ARGS) == 0
    out = capsys.readouterr().out
    expected_total = format_bytes(288_000_000)
    assert expected_total == "274.66 MiB"
    assert "Total" in out
    assert expected_total in out
    for label in ("Parameters", "Gradients", "Master weights", "Optimizer state", "Activations"):
        assert label in out
    assert "100.0%" in out
    assert "20,000,000 parameters" in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("124M", 124_000_000),
        ("124m", 124_000_000),
        ("7B", 7_000_000_000),
        ("1.5B", 1_500_000_000),
        ("20K", 20_000),
        ("20e6", 20_000_000),
        ("7e9", 7_000_000_000),
        ("20_000_000", 20_000_000),
        ("20,000,000", 20_000_000),
    ],
)
def test_count_suffixes(capsys: pytest.CaptureFixture[str], text: str, expected: int) -> None:
    data = _run_json(capsys, "estimate", "--params", text, "--optimizer", "none")
    assert data["parameters"] == expected
    assert data["parameters_bytes"] == 4 * expected


def test_suffixes_apply_to_activations_and_batch(capsys: pytest.CaptureFixture[str]) -> None:
    data = _run_json(
        capsys,
        "estimate",
        "--params",
        "1K",
        "--batch-size",
        "2",
        "--activations-per-sample",
        "3M",
        "--precision",
        "bf16",
    )
    assert data["activations_bytes"] == 2 * 3_000_000 * 2


def test_trainable_fraction_option(capsys: pytest.CaptureFixture[str]) -> None:
    data = _run_json(capsys, "estimate", "--params", "1000", "--optimizer", "sgd", "--trainable-fraction", "0.5")
    assert data["trainable_fraction"] == 0.5
    assert data["gradients_bytes"] == 500 * 4


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--params", "7X"], ["--params", "'7X'"]),
        (["--params", "-5"], ["--params", "'-5'"]),
        (["--params", "1.5"], ["--params", "'1.5'"]),
        (["--params", "10", "--batch-size", "0"], ["--batch-size must be", "got 0"]),
        (["--params", "10", "--batch-size", "many"], ["--batch-size", "'many'"]),
        (["--params", "10", "--optimizer", "lion"], ["--optimizer must be", "adamw", "got 'lion'"]),
        (["--params", "10", "--precision", "fp8"], ["--precision must be", "got 'fp8'"]),
        (["--params", "10", "--trainable-fraction", "2"], ["--trainable-fraction must be", "got 2.0"]),
        (["--params", "10", "--trainable-fraction", "half"], ["--trainable-fraction", "'half'"]),
    ],
)
def test_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], fragments: list[str]
) -> None:
    assert main(["estimate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("memfit: error: ")
    assert "Traceback" not in captured.err
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_required_argument_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate"]) == 2
    assert "--params" in capsys.readouterr().err


def test_subcommand_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "error" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("memfit ")
    assert len(out.split()) == 2


def test_python_dash_m_memfit_runs_the_cli() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-m", "memfit", *SEED_ARGS, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["total_bytes"] == 288_000_000

    bad = subprocess.run(
        [sys.executable, "-m", "memfit", "estimate", "--params", "lots"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("memfit: error: ")
    assert "Traceback" not in bad.stderr


def test_the_console_command_flushes_runs_exit_handlers_and_exits_with_the_answers_status(tmp_path: Path) -> None:
    """``console()`` skips the interpreter's teardown: the output must still all arrive, exit handlers still run,
    and the status be ``main()``'s (0 for an answer, 2 for bad input)."""
    marker = tmp_path / "handled"
    script = (
        "import atexit, pathlib, sys\n"
        f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'ran')\n"
        "from memfit.cli.main import console\n"
        "sys.argv = ['memfit', *sys.argv[1:]]\n"
        "console()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    for argv, status in (([*SEED_ARGS, "--json"], 0), (["estimate", "--params", "lots"], 2)):
        marker.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                              timeout=120, check=False)  # fmt: skip
        assert done.returncode == status, done.stderr
        assert marker.read_text() == "ran"
        if status == 0:
            assert json.loads(done.stdout)["total_bytes"] == 288_000_000  # the whole answer, flushed
        else:
            assert done.stderr.startswith("memfit: error: ") and done.stdout == ""


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        [*SEED_ARGS, "--json"],
        SEED_ARGS,
        ["plan", "--hf-config", "{config}", "--budget", "1GiB", "--seq-len", "16", "--json"],
        ["plan", "--hf-config", "{config}", "--budget", "1GiB", "--seq-len", "16"],
    ],
    ids=["estimate-json", "estimate-table", "plan-json", "plan-table"],
)
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(tmp_path: Path, argv: list[str]) -> None:
    """``memfit ... | head -1``: the reader is gone before the output is written; no traceback, SIGPIPE's status."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    read, write = os.pipe()
    os.close(read)  # a reader that has already gone
    try:
        result = subprocess.run(
            [sys.executable, "-m", "memfit", *(arg.format(config=config) for arg in argv)],
            stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert result.stderr == "" and result.returncode == 141


@pytest.mark.parametrize(
    "argv",
    [["estimate"], ["estimate", "--params", "10", "--nope"], ["plan", "--hf-config", "gpt2", "--checkpointing", "x"]],
)
def test_usage_errors_are_one_line_too(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: ") and "--help" in lines[0]


def test_the_command_line_builds_transformers_models_without_their_optional_libraries_and_docstrings():
    """transformers' assisted generation imports scikit-learn (and scipy, pandas) for a ROC curve, and its losses
    scipy for a matching; a model built on the meta device uses neither, nor the docstrings ``@auto_docstring``
    writes. The command line's block builds without them, and leaves transformers doing what it would have done:
    the real checks back, each guarded function importing its library when called, docstrings written again for
    what is imported after the block."""
    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    script = (
        "import sys\n"
        "import numpy as np\n"
        "from memfit.integrations.huggingface.internals import lean_model_imports\n"
        "with lean_model_imports():\n"
        "    from memfit.presets import from_hf_config\n"
        "    spec = from_hf_config('gpt2', seq_len=32, layers=1)\n"
        "print('sklearn' in sys.modules, 'scipy' in sys.modules, type(spec.model).__doc__ is None)\n"
        "import transformers.utils as utils\n"
        "import transformers.generation.candidate_generator as generation\n"
        "import transformers.loss.loss_for_object_detection as detection\n"
        "print(generation.is_sklearn_available is utils.is_sklearn_available,"
        " detection.is_scipy_available is utils.is_scipy_available, utils.auto_docstring.__module__)\n"
        "cost, labels, scores = np.array([[4.0, 1.0], [2.0, 8.0]]), [0, 1, 1, 0], [0.2, 0.9, 0.6, 0.4]\n"
        "matched = detection.linear_sum_assignment(cost)\n"
        "curve = generation.roc_curve(labels, scores)\n"
        "from scipy.optimize import linear_sum_assignment\n"
        "from sklearn.metrics import roc_curve\n"
        "print(matched[1].tolist(), all(np.array_equal(a, b) for a, b in zip(matched, linear_sum_assignment(cost))),"
        " all(np.array_equal(a, b) for a, b in zip(curve, roc_curve(labels, scores))))\n"
        "from transformers.models.bert.modeling_bert import BertModel\n"
        "print(type(spec.model).__name__, 'config' in (BertModel.__doc__ or ''))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "False False True",
        "True True transformers.utils.auto_docstring",
        "[1, 0] True True",
        "GPT2LMHeadModel True",
    ]
    plain = (
        "import sys, transformers.generation.candidate_generator, transformers.loss.loss_utils\n"
        "from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel\n"
        "print('sklearn' in sys.modules, 'scipy' in sys.modules, GPT2LMHeadModel.__doc__ is None)"
    )
    plain = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, timeout=300, check=False)
    assert plain.stdout.split() == ["True", "True", "False"], plain.stderr  # as transformers imports itself
