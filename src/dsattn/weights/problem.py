"""The arguments of ``fp8_block_linear`` and ``mxfp4_linear``, checked once: the dtypes, the shapes, the block."""
from __future__ import annotations

from dataclasses import dataclass

import torch

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (``float8_e8m0fnu``, or its bits as uint8) -> float32 2^(e - 127); 0xFF is NaN."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"scale: expected float8_e8m0fnu or uint8 (ue8m0 bits), got {scale.dtype}")
    return scale.to(torch.float32)


def quantize_fp8_blocks(w: torch.Tensor, block=(128, 128), ue8m0: bool = False):
    """``w`` [N, K] -> (e4m3fn codes [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]): each block's largest
    magnitude maps to 448 (``ue8m0``: the scale rounded up to a power of two, as DeepSeek-V4's checkpoints)."""
    bn, bk = block
    N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = w.new_zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.view(nb * bn, kb * bk)[:N, :K].contiguous(), scale.contiguous()


# e2m1 (FP4) values by code, sign in bit 3: DeepSeek-V4's routed experts, OCP MXFP4
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_GROUP = 32


def quantize_mxfp4(w: torch.Tensor):
    """``w`` [N, K] (K a multiple of 32) -> (e2m1 codes two a byte, element 2i in the low nibble, uint8 [N, K / 2];
    ue8m0 scales uint8 [N, K / 32], ``2^ceil(log2(amax / 6))``: a group's largest value lands in e2m1's range), as
    DeepSeek-V4 ships its routed experts."""
    rows, cols = w.shape
    if cols % MX_GROUP:
        raise ValueError(f"w: {cols} columns, expected a multiple of {MX_GROUP}")
    g = w.float().reshape(rows, cols // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]
    code = (x.abs()[..., None] - torch.tensor(E2M1[:8])).abs().argmin(-1)     # nearest magnitude (ties: the smaller)
    code = code + 8 * (x < 0).long() * (code > 0).long()
    flat = code.reshape(rows, cols).to(torch.uint8)
    return flat[:, 0::2] | (flat[:, 1::2] << 4), (exp + 127).to(torch.uint8)


@dataclass
class QuantLinearProblem:
    x: torch.Tensor            # [M, K], the model dtype
    codes: torch.Tensor        # uint8: fp8 [N, K] (e4m3fn bits), fp4 [N, K / 2] (e2m1 pairs)
    scale: torch.Tensor        # [ceil(N / bn), ceil(K / bk)] float32, or ue8m0 exponents as uint8 (read as they are)
    bn: int
    bk: int
    bias: torch.Tensor | None
    out_shape: tuple
    format: str = "fp8"        # "fp8" | "fp4"

    @property
    def M(self) -> int:
        return self.x.shape[0]

    @property
    def N(self) -> int:
        return self.codes.shape[0]

    @property
    def K(self) -> int:
        return self.x.shape[1]

    @property
    def scale_float(self) -> torch.Tensor:
        return self.scale if self.scale.dtype == torch.float32 else e8m0_to_float(self.scale)


def _scale_bits(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales as they are, ue8m0 ones as their uint8 bits (the kernels read them without a widened copy)."""
    return (scale if scale.dtype == torch.float32 else scale.view(torch.uint8)).contiguous()


def _check_act_and_bias(x, bias, N):
    if not isinstance(x, torch.Tensor) or x.dtype not in ACT_DTYPES:
        raise TypeError(f"x: expected a bfloat16 / float16 / float32 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1:
        raise ValueError("x: expected [..., K], got a 0-dim tensor")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (N,)):
        raise ValueError(f"bias: expected [N={N}], got {getattr(bias, 'shape', type(bias).__name__)}")


def _check_devices(x, **tensors):
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, x on {x.device}: expected one device")


def parse_fp8_linear(x, weight, weight_scale, block_size, bias=None) -> QuantLinearProblem:
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"weight: expected float8_e4m3fn codes (or their bits as uint8), got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    _check_act_and_bias(x, bias, N)
    if x.shape[-1] != K:
        raise ValueError(f"x: last dim {x.shape[-1]} must equal weight's K={K}")
    block = list(block_size)
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"block_size: expected [block_n, block_k], both positive, got {block}")
    bn, bk = (int(b) for b in block)
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.dtype not in SCALE_DTYPES + (torch.uint8,):
        raise TypeError(f"weight_scale: expected float32 or float8_e8m0fnu (ue8m0), got "
                        f"{getattr(weight_scale, 'dtype', type(weight_scale).__name__)}")
    want = (-(-N // bn), -(-K // bk))
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"weight_scale: expected shape [ceil(N / {bn}), ceil(K / {bk})] = {list(want)} for weight "
                         f"[{N}, {K}], got {list(weight_scale.shape)}")
    _check_devices(x, weight=weight, weight_scale=weight_scale, bias=bias)
    return QuantLinearProblem(x=x.reshape(-1, K), codes=weight.view(torch.uint8), scale=_scale_bits(weight_scale), bn=bn,
                              bk=bk, bias=bias, out_shape=(*x.shape[:-1], N))


def parse_mxfp4_linear(x, weight, weight_scale, bias=None) -> QuantLinearProblem:
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"weight: expected e2m1 codes packed two a byte (uint8 [N, K / 2]), got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [N, K / 2], got shape {tuple(weight.shape)}")
    N, K = weight.shape[0], 2 * weight.shape[1]
    _check_act_and_bias(x, bias, N)
    if x.shape[-1] != K:
        raise ValueError(f"x: last dim {x.shape[-1]} must equal 2 x weight's packed columns = {K}")
    if K % MX_GROUP:
        raise ValueError(f"x: K={K} must be a multiple of {MX_GROUP} (one scale a group of {MX_GROUP})")
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.dtype not in SCALE_DTYPES + (torch.uint8,):
        raise TypeError(f"weight_scale: expected ue8m0 (float8_e8m0fnu or its uint8 bits) or float32, got "
                        f"{getattr(weight_scale, 'dtype', type(weight_scale).__name__)}")
    if tuple(weight_scale.shape) != (N, K // MX_GROUP):
        raise ValueError(f"weight_scale: expected shape [N, K / {MX_GROUP}] = {[N, K // MX_GROUP]} for weight "
                         f"{list(weight.shape)}, got {list(weight_scale.shape)}")
    _check_devices(x, weight=weight, weight_scale=weight_scale, bias=bias)
    return QuantLinearProblem(x=x.reshape(-1, K), codes=weight.view(torch.uint8), scale=_scale_bits(weight_scale), bn=1,
                              bk=MX_GROUP, bias=bias, out_shape=(*x.shape[:-1], N), format="fp4")
