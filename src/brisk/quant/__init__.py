"""Weight quantization: primitives (qparams, quantize/dequantize, bit packing, NF4) and, on top, the methods.

The number formats are fixed in `primitives.py` (uniform affine int2/3/4/8 with integer zero points, the
"brisk-packed v1" bit layout, and QLoRA's NormalFloat4); the kernels and the checkpoint format read the same
conventions.
"""
