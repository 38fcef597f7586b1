"""Reading GPUs for memory.devices: auto: nvidia-smi's output, a fake nvidia-smi, and the refusal when none."""

from __future__ import annotations

from pathlib import Path

import pytest

from capyctl.adapters import devices
from capyctl.domain.errors import InvalidConfig
from capyctl.domain.memory import Device

GiB = 2**30


def test_nvidia_smi_lines_become_devices_with_a_reserve() -> None:
    text = "0, NVIDIA H200, 143771\n1, NVIDIA GeForce RTX 4090, 24564\n\n"
    assert devices.parse_nvidia_smi(text) == [
        Device(name="gpu0", capacity=143771 * 2**20, reserve=143771 * 2**20 // 20),
        Device(name="gpu1", capacity=24564 * 2**20, reserve=24564 * 2**20 // 20),
    ]
    assert devices.reserve_for(8 * GiB) == GiB  # at least 1 GiB


def test_a_fake_nvidia_smi_is_run_with_the_query(tmp_path: Path) -> None:
    program = tmp_path / "nvidia-smi"
    program.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=index,name,memory.total" ] && echo "0, Fake GPU, 2560"\n')
    program.chmod(0o755)
    assert devices.from_nvidia_smi(str(program)) == [Device(name="gpu0", capacity=2560 * 2**20, reserve=GiB)]
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\nexit 9\n")
    broken.chmod(0o755)
    assert devices.from_nvidia_smi(str(broken)) is None


def test_no_gpu_at_all_is_a_clear_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "from_nvml", lambda: None)
    monkeypatch.setattr(devices, "from_nvidia_smi", lambda program=None: None)
    with pytest.raises(InvalidConfig, match="memory.devices: auto found no GPU"):
        devices.read_devices()
