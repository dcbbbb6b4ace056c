"""Re-type a GGUF file's weights (F32, F16, BF16, Q8_0, Q4_1), keeping its metadata: llama.cpp's `llama-quantize`.

    retype_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-f16.gguf", "f16")

Every tensor is decoded to float32 with the `gguf` package's own dequantizers and written again at the new
type; one-dimensional tensors (norms, biases) stay F32, as llama.cpp's converter keeps them. Metadata fields
(architecture, hyper-parameters, tokenizer, chat template) are copied unchanged but `general.file_type`.
Re-typing a 4-bit file to F16 or Q8_0 does not bring back the lost precision; it gives the same weights at a
wider type, which is what an engine comparison at matched precision needs (`brisk bench compare`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

OUT_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
}


def retype_gguf(src: str | Path, dst: str | Path, outtype: str) -> Path:
    """Write `src`'s model to `dst` with every matrix at `outtype` (one of OUT_TYPES); returns dst."""
    if outtype not in OUT_TYPES:
        raise ValueError(f"unknown GGUF output type {outtype!r}; choose one of {', '.join(OUT_TYPES)}")
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"the output {dst} is the input file; choose another path")
    qtype, ftype = OUT_TYPES[outtype]
    try:
        reader = GGUFReader(src)
    except (ValueError, OSError) as e:
        raise ValueError(f"{src} is not a readable GGUF file: {e}") from e
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{src} has no general.architecture field; is it a model GGUF?")
    writer = GGUFWriter(dst, str(arch_field.contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    writer.add_file_type(ftype)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)  # numpy order: [rows, cols]
        if values.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.ascontiguousarray(values))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:  # BF16, Q8_0 and Q4_1 are byte arrays; the writer gets the element type to recover the shape
            writer.add_tensor(t.name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
