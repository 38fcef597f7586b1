"""Reading the machine's GPUs for ``memory.devices: auto``: NVML first, then ``nvidia-smi``.

NVML comes from the ``nvidia-ml-py`` package (``pynvml``) when it is
installed and the driver's library loads; otherwise ``nvidia-smi
--query-gpu=index,name,memory.total --format=csv,noheader,nounits`` is run
(5 s at most). Each GPU becomes a device named ``gpu<index>`` with its total
memory as capacity and a reserve of the larger of 1 GiB and 5 % of it, kept
for the driver and whatever else runs there.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from capyctl.domain.errors import InvalidConfig
from capyctl.domain.memory import Device

log = logging.getLogger("capyctl.devices")
GiB = 2**30


def reserve_for(capacity: int) -> int:
    return max(GiB, capacity // 20)


def _device(index: int, total: int) -> Device:
    return Device(name=f"gpu{index}", capacity=total, reserve=reserve_for(total))


def from_nvml() -> list[Device] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError and its subclasses: no driver, no GPU
        log.info("NVML did not load (%s); trying nvidia-smi", exc)
        return None
    try:
        return [
            _device(i, int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total))
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
    finally:
        pynvml.nvmlShutdown()


def parse_nvidia_smi(text: str) -> list[Device]:
    """Devices from ``index, name, memory.total`` lines (MiB, no units)."""
    devices = []
    for line in text.splitlines():
        if not line.strip():
            continue
        index, *_, total = (part.strip() for part in line.split(","))
        devices.append(_device(int(index), int(float(total)) * 2**20))
    return devices


def from_nvidia_smi(program: str | None = None) -> list[Device] | None:
    program = program or shutil.which("nvidia-smi")
    if program is None:
        return None
    try:
        done = subprocess.run(
            [program, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
        return parse_nvidia_smi(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.info("nvidia-smi gave no devices: %s", exc)
        return None


def read_devices() -> tuple[Device, ...]:
    """The GPUs of this machine; refuses to start when none can be read (the file asked for them)."""
    for reader in (from_nvml, from_nvidia_smi):
        devices = reader()
        if devices:
            return tuple(devices)
    raise InvalidConfig(
        "memory.devices: auto found no GPU: NVML (the nvidia-ml-py package) did not load and nvidia-smi "
        "gave nothing; declare the devices in the file (name, capacity, reserve) or remove memory.devices"
    )
