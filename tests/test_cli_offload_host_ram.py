"""--gpus auto states the host RAM of the offload options it shows, and flags one this machine cannot hold."""

from __future__ import annotations

import pytest

from memfit.cli.main import main


def test_gpus_auto_states_the_host_ram_of_the_offload_it_suggests(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import memfit.cli.sharding as sharding

    monkeypatch.setattr(sharding, "machine_ram_bytes", lambda: 4 * 2**30)
    argv = ["plan", "--hf-config", "llama-3-8b", "--layers", "1", "--seq-len", "64", "--gpus", "auto",
            "--budget", "6GiB"]  # fmt: skip
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "zero2+offload-optimizer ~4.21 GiB (host 18.91 GiB a node)" in out
    assert (
        "offloading (zero2+offload-optimizer) at 1 GPU(s) would need 18.91 GiB of host RAM a node; more than this "
        "machine's 4.00 GiB" in out
    )
