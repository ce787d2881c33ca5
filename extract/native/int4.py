"""INT4 "pack-quantized" weights (compressed-tensors), as Kimi-K2.5 stores its routed experts.

Layout (docs/kimi-k25.md): symmetric, group size 32 along the input dimension, no zero point.

    weight_packed  int32 [out, in/8]   eight 4-bit values per int32, column 8j+n in nibble n
                                       (n = 0 is the least significant), each stored as q + 8
    weight_scale   bf16  [out, in/32]
    W[o, i] = (nibble(o, i) - 8) * scale[o, i // 32]

A top nibble >= 8 makes the int32 negative, so every nibble is masked after an arithmetic shift.
`dequantize_int4` is the vectorized path used by the model; `dequantize_int4_reference` is a
plain element-by-element transcription of the formula above, kept beside it to test against.
The weights stay packed in memory; the model dequantizes one expert at a time right before its
matmul (a fused INT4 kernel can replace `dequantize_int4` behind the same call later).
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # 4-bit values per int32
GROUP_SIZE = 32  # input columns sharing one scale

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble n sits at bits 4n..4n+3


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., out, in/8] -> int8 [..., out, in], the signed values q = nibble - 8."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int4: weight_packed must be int32, got {packed.dtype}")
    shifts = _SHIFTS.to(packed.device)
    # [..., in/8, 1] >> [8] -> [..., in/8, 8]; & 0xF undoes the sign extension of the shift.
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - 8).to(torch.int8).flatten(-2)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16, group_size: int = GROUP_SIZE
) -> torch.Tensor:
    """(int32 [..., out, in/8], scale [..., out, in/group]) -> dtype [..., out, in]."""
    values = unpack_int4(packed)
    in_features = values.shape[-1]
    if scale.shape[-1] * group_size != in_features or scale.shape[:-1] != values.shape[:-1]:
        raise ValueError(
            f"dequantize_int4: weight_scale shape {tuple(scale.shape)} does not match weight_packed "
            f"{tuple(packed.shape)} at group size {group_size} (expected [..., {in_features // group_size}])"
        )
    # [..., out, in/g, g] * [..., out, in/g, 1]: every group of columns shares one scale.
    grouped = values.to(dtype).unflatten(-1, (in_features // group_size, group_size))
    return (grouped * scale.to(dtype).unsqueeze(-1)).flatten(-2)


def dequantize_int4_reference(packed: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Element by element, float64 [out, in]: the formula of the module docstring, nothing clever."""
    out_features, words = packed.shape
    result = torch.empty(out_features, words * PACK_FACTOR, dtype=torch.float64)
    for o in range(out_features):
        for w in range(words):
            word = int(packed[o, w]) & 0xFFFFFFFF  # the 32 raw bits, as an unsigned number
            for n in range(PACK_FACTOR):
                i = w * PACK_FACTOR + n
                nibble = (word >> (4 * n)) & 0xF
                result[o, i] = (nibble - 8) * float(scale[o, i // group_size])
    return result


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (int8 q [out, in] in [-8, 7], bf16 scale [out, in/group]).

    Symmetric per-group quantization, used to build test fixtures and tiny checkpoints (packing
    itself is left to compressed-tensors' pack_to_int32 there, so the layout is its own).
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"quantize_int4: input dimension {in_features} is not a multiple of {group_size}")
    grouped = weight.float().unflatten(-1, (in_features // group_size, group_size))
    scale = (grouped.abs().amax(-1) / 7.0).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(grouped / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return q.flatten(-2), scale
