"""Whether oneDNN runs bfloat16 here (``runtime.mkldnn_bf16``): torch's private operator
where it is as written against, the same rule read from the CPU's capabilities where it
has moved, and both give this machine's answer."""

from __future__ import annotations

import types

import pytest
import torch

from dlrmflow.runtime import mkldnn_bf16
from dlrmflow.runtime.mkldnn_bf16 import bf16_supported, bf16_supported_by_capabilities
from dlrmflow.train.model.device import autocast_supported


def test_the_installed_torch_has_the_operator_and_the_fallback_agrees_with_it():
    # Fails when torch drops the operator (the fallback would then answer), or when the
    # fallback's rule no longer matches oneDNN's on this machine.
    ask = torch.ops.mkldnn._is_mkldnn_bf16_supported
    expected = torch.backends.mkldnn.is_available() and bool(ask())
    assert bf16_supported() is expected
    assert bf16_supported_by_capabilities() is expected
    assert autocast_supported(torch.device("cpu")) is expected


@pytest.fixture
def without_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())


X86_AVX512 = {
    "architecture": "x86_64",
    "avx2": True,
    "avx512_f": True,
    "avx512_bw": True,
    "avx512_vl": True,
    "avx512_dq": True,
}


@pytest.mark.parametrize(
    ("capabilities", "expected"),
    [
        (X86_AVX512, True),
        ({**X86_AVX512, "avx512_dq": False}, False),  # an AVX-512 without all its core parts
        ({"architecture": "x86_64", "avx2": True, "avx_vnni": True}, False),
        (
            {
                "architecture": "x86_64",
                "avx_vnni": True,
                "avx_vnni_int8": True,
                "avx_ne_convert": True,
            },
            True,
        ),
        ({"architecture": "aarch64", "neon": True, "bf16": True}, True),
        ({"architecture": "aarch64", "neon": True, "bf16": False}, False),
        # An Arm CPU is not asked about x86's features.
        ({**X86_AVX512, "architecture": "aarch64"}, False),
    ],
    ids=["avx512", "avx512_without_dq", "avx2", "avx2_vnni_2", "arm_bf16", "arm", "arm_named"],
)
def test_without_the_operator_the_cpus_capabilities_answer(
    without_the_operator, monkeypatch, capabilities, expected
):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert bf16_supported() is expected


def test_without_onednn_nothing_runs_bfloat16(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: X86_AVX512)
    assert bf16_supported() is False
    assert mkldnn_bf16.bf16_supported_by_capabilities() is False
