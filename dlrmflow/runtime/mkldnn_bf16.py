"""Whether torch's oneDNN (mkldnn) kernels run bfloat16 on this CPU, as oneDNN itself decides.

Autocast to bfloat16 works on every CPU, but only where oneDNN has bfloat16 kernels for
the CPU's instructions is it more than an emulation (``train.precision=bf16`` is then
worth running; the precision benchmark records which it measured). torch answers through
an operator of its own, not a public function. What it reaches into, written against
torch 2.13.0: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``, which asks oneDNN for the
instruction set it runs with (so it honours ``ONEDNN_MAX_CPU_ISA``); torch's Inductor asks
it the same way. Nothing is gained in speed; the answer is the one the kernels act on.

Fallback, where the operator is gone: the same rule read from torch's public
``torch.cpu.get_capabilities()``: on x86, AVX-512 (its F, BW, VL and DQ parts) or
AVX-VNNI with AVX-NE-CONVERT and AVX-VNNI-INT8; on Arm, BF16 (as ideep's
``has_bf16_type_support`` decides, without ``ONEDNN_MAX_CPU_ISA``); False without oneDNN.
``tests/runtime/test_mkldnn_bf16.py`` checks that both give this machine's answer, and
fails when the installed torch no longer has the operator.
"""

from __future__ import annotations

import torch

# The CPU features whose presence makes oneDNN run bfloat16 (any one set of them).
_X86_SETS = (
    ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"),
    ("avx_vnni", "avx_vnni_int8", "avx_ne_convert"),
)
_ARM_SETS = (("bf16",),)


def bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 kernels on this CPU (False where torch has no oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        ask = torch.ops.mkldnn._is_mkldnn_bf16_supported
    except (AttributeError, RuntimeError):  # the operator is not registered in this torch
        return bf16_supported_by_capabilities()
    return bool(ask())


def bf16_supported_by_capabilities() -> bool:
    """The fallback's answer: oneDNN's rule applied to ``torch.cpu.get_capabilities()``."""
    if not torch.backends.mkldnn.is_available():
        return False
    capabilities = torch.cpu.get_capabilities()
    sets = _ARM_SETS if capabilities.get("architecture") in ("aarch64", "arm64") else _X86_SETS
    return any(all(capabilities.get(feature, False) for feature in s) for s in sets)
