"""Write a GGUF file's model in another tensor type, with the `gguf` package (metadata copied as is).

Every matrix is dequantized to fp32 (gguf's reference dequantization) and quantized to `--type` by
gguf's reference quantizer (bit-exact with llama.cpp's for Q8_0 and Q4_0); matrices already of that
type keep their bytes, and so do the `--keep` ones: by default the vocabulary matrices
(`token_embd.weight`, `output.weight`), which llama.cpp's `llama-quantize` keeps wider than a 4-bit
file's other matrices (Q8_0 where the hidden size is not a multiple of 256, as SmolLM2's 576, else
Q6_K); vectors (norms) stay F32. Used to make the GGUF Q8_0 and Q4_0 SmolLM2 of bench/README.md from
the bundled Q4_1 file (whose token_embd is Q8_0):

    python bench/gguf_requantize.py --type Q8_0 --out /tmp/SmolLM2-135M-Instruct.Q8_0.gguf
    python bench/gguf_requantize.py --type Q4_0 --out /tmp/SmolLM2-135M-Instruct.Q4_0.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from tokenmill.models.model_loader.hub import _GGUF_FILE, _gguf_package_dir

VOCABULARY_MATRICES = ("token_embd.weight", "output.weight")


def requantize(source: Path, target: Path, tensor_type: str, keep: tuple[str, ...] = VOCABULARY_MATRICES) -> None:
    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    reader = gguf.GGUFReader(source)
    architecture = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(target, architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # (the writer writes these itself)
        value = field.contents()
        if key == "general.file_type":
            value = int(getattr(gguf.LlamaFileType, "MOSTLY_" + tensor_type))
        kind = field.types[0]
        writer.add_key_value(key, value, kind, sub_type=field.types[1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if len(tensor.shape) < 2 or tensor.tensor_type == qtype or tensor.name in keep:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = gguf.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, gguf.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=None, help="GGUF file (default: the bundled SmolLM2 Q4_1)")
    parser.add_argument("--type", default="Q8_0", help="the matrices' new type (default: Q8_0)")
    parser.add_argument(
        "--keep",
        nargs="*",
        default=list(VOCABULARY_MATRICES),
        help="tensors whose bytes are kept as they are (default: the vocabulary matrices, as llama-quantize)",
    )
    parser.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    args = parser.parse_args()
    requantize(args.source or _gguf_package_dir() / _GGUF_FILE, args.out, args.type, tuple(args.keep))
    print(args.out)


if __name__ == "__main__":
    main()
