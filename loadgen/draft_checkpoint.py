"""A draft checkpoint cut from a model: its first L decoder layers, its embeddings, final norm and
LM head, saved as a Hugging Face checkpoint folder that ``--draft-model`` loads.

Speculative decoding with ``--speculative draft`` needs a smaller model with the same tokenizer;
where none exists (there is no SmolLM2 smaller than 135M), the model's own first layers are the
honest stand-in: the same proposals as ``--speculative self --draft-layers L``, but run as a
second model over its own KV cache, so the two measure the draft proposer's own costs against
each other. The weights are the model's as the loader reads them (a quantized ``.gguf`` file's
dequantized), stored in ``--dtype``; the folder has no tokenizer (the draft never needs one).

    python -m mqinfer.loadgen.draft_checkpoint --model MODEL --layers L --out FOLDER [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator


def _source(model: str) -> tuple[dict, Iterator]:
    """The model's HF config and its (HF name, tensor) pairs."""
    from mqinfer.workers.engine import loader

    if model.lower().endswith(".gguf"):
        from mqinfer.workers.engine.gguf import GGUFCheckpoint

        checkpoint = GGUFCheckpoint(model)
        return dict(checkpoint.hf_config), checkpoint.weights()
    folder = Path(model)
    if not (folder / "config.json").exists():
        raise SystemExit(f"{model}: neither a .gguf file nor a checkpoint folder with config.json")
    hf = json.loads((folder / "config.json").read_text())
    return hf, loader.iter_checkpoint(loader.weight_files(folder))


def cut_checkpoint(model: str, layers: int, out: str | Path, dtype: str = "float32") -> Path:
    """Write the first ``layers`` decoder layers of ``model`` (a checkpoint folder or a ``.gguf``
    file), with its embeddings, final norm and LM head, to the folder ``out``."""
    from safetensors.torch import save_file

    from mqinfer.workers.engine.loader import resolve_dtype

    hf, weights = _source(model)
    total = int(hf["num_hidden_layers"])
    if not 1 <= layers < total:
        raise SystemExit(f"--layers must be between 1 and {total - 1} for {model} ({total} layers), got {layers}")
    torch_dtype = resolve_dtype(dtype)
    kept = {}
    for name, tensor in weights:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        kept[name] = tensor.to(torch_dtype).contiguous()
    hf["num_hidden_layers"] = layers
    hf["torch_dtype"] = dtype
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.draft_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Checkpoint folder or .gguf file to cut.")
    p.add_argument("--layers", type=int, required=True, help="Decoder layers the draft keeps (the first L).")
    p.add_argument("--out", required=True, help="Folder to write the draft checkpoint to.")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="Stored dtype of the draft's weights (default: float32).")
    args = p.parse_args(argv)
    folder = cut_checkpoint(args.model, args.layers, args.out, args.dtype)
    print(f"wrote the first {args.layers} layers of {args.model} to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
