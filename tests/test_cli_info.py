"""`torch-pjrt info` and the command line's top level."""

from __future__ import annotations

import json

import pytest
import torch

from torch_pjrt.cli.main import build_parser, main


def test_info_json(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_PJRT_EXAMPLE_SETTING", "1")
    assert main(["info", "--format", "json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["platform"] == torch.pjrt.get_device_properties().platform
    assert len(info["devices"]) == torch.pjrt.device_count()
    assert info["devices"][0]["name"] and info["devices"][0]["total_memory"] > 0
    assert info["versions"]["torch"] == torch.__version__
    assert set(info["versions"]) == {"torch", "jax", "jaxlib", "torch-pjrt"}
    assert info["eager_mode"] == torch.pjrt.eager_mode.value
    assert info["environment"]["TORCH_PJRT_EXAMPLE_SETTING"] == "1"
    assert "cache_dir" in info and info["cache_bytes"] >= 0
    # no torchrun environment here: the backend's collectives go through host copies, and info says why
    assert info["distributed"]["engine"] == "host" and "torchrun" in info["distributed"]["reason"]


def test_info_text(capsys: pytest.CaptureFixture) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("platform")
    assert "pjrt:0" in out and "eager mode" in out and "cache dir" in out and "torch " in out
    assert "collectives   gloo over host copies" in out


def test_no_command_prints_help(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 2
    assert "usage: torch-pjrt" in capsys.readouterr().err


def test_subcommands_registered() -> None:
    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"info", "scan", "run", "bench"} <= set(commands)
