"""Spec constants of the three weight formats, in one place.

Sources: OCP Microscaling Formats (MX) v1.0 (E2M1 element, E8M0 scale, block 32); NVIDIA's NVFP4
(E2M1 element, E4M3 block scale over 16 elements, FP32 per-tensor scale); the float8_e4m3fn
range (max 448).  The rounding rules and scale arithmetic follow compressed-tensors, which is
what vLLM loads these checkpoints with (see docs/formats.md)."""

from qstream.units import FLOAT_DTYPES

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest E2M1 magnitude
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of index 0..7

MXFP4_BLOCK = 32
MXFP4_E8M0_BIAS = 127
MXFP4_ELEM_EMAX = 2  # floor(log2(FP4_MAX)): the block amax maps into E2M1's top binade

NVFP4_BLOCK = 16
NVFP4_ZERO_BLOCK_SCALE = 0.125  # compressed-tensors' replacement for a zero FP8 block scale

SUPPORTED_DTYPES = FLOAT_DTYPES  # the weight dtypes the formats take (qstream/units.py)
