"""The host CPU as a verl platform (registered by :func:`fulmen.algorithm.trainer.verl_backend.register_cpu`): verl's
platform layer knows NVIDIA, Huawei and AMD accelerators only. Imported only when verl trains on the CPU."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from verl.plugin.platform.platform_base import PlatformBase

from fulmen.algorithm.trainer.verl_backend import CPU

__all__ = ["PlatformCPU"]


class PlatformCPU(PlatformBase):
    """The host CPU as a verl platform: one device ("cpu"), gloo collectives, nothing to synchronise."""

    device_name = property(lambda self: CPU)
    vendor_name = property(lambda self: CPU)
    device_module = property(lambda self: torch.cpu)

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:  # verl moves tensors with .to(current_device()): "cpu", not 0 (cuda:0)
        return CPU

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def communication_backend_name(self) -> str:
        return "gloo"

    def empty_cache(self) -> None:
        pass

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return None, None

    def visible_devices_envvar(self) -> str:
        return "CPU_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str):
        return nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None
