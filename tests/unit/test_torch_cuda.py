"""The attention kernels Fulmen trusts on CUDA: cuDNN's SDPA off where a model goes on a GPU, untouched on the CPU."""

from __future__ import annotations

import pytest
import torch

from fulmen.infra.torch_cuda import trusted_attention


@pytest.fixture
def cudnn_flag():
    """Restore torch's process-wide cuDNN SDPA flag after the test."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_cpu_keeps_every_kernel(cudnn_flag, monkeypatch):
    monkeypatch.delenv("FULMEN_CUDNN_SDPA", raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert trusted_attention("cpu") is False
    assert trusted_attention(torch.device("cpu")) is False
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_cuda_device_turns_cudnn_attention_off_once_and_for_all(cudnn_flag, monkeypatch):
    monkeypatch.delenv("FULMEN_CUDNN_SDPA", raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert trusted_attention("cuda:1") is True  # the flag is process-wide: no GPU is needed to set it
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert trusted_attention(torch.device("cuda")) is True  # idempotent
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_environment_can_keep_cudnn_attention(cudnn_flag, monkeypatch):
    monkeypatch.setenv("FULMEN_CUDNN_SDPA", "1")
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert trusted_attention("cuda") is False
    assert torch.backends.cuda.cudnn_sdp_enabled()
