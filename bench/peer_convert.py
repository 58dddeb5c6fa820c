"""Run llama.cpp's own `convert_hf_to_gguf.py` on a bench/synthetic_model.py directory.

    python bench/peer_convert.py LLAMA_CPP_DIR MODEL_DIR --outtype f16 --outfile OUT.gguf

Two changes to the converter, made here rather than in its source, both for the synthetic tokenizer (GPT-2's
byte-level pre-tokenizer, no merges):
- it names a BPE tokenizer's pre-tokenizer by hashing the ids of a fixed text and looking the hash up in a table of
  published models; the synthetic tokenizer is in no such table, so it is declared "gpt-2", the one it has;
- llama.cpp refuses a BPE vocabulary without `tokenizer.ggml.merges` ("cannot find tokenizer merges"), and GGUF
  has no empty arrays, so a tokenizer without merges gets one, of two NUL bytes, which no text we send contains
  (and whose result is no token: llama.cpp then keeps the bytes).
Prompts reach llama-server as token ids in the benchmarks, so its text tokenizer is never used there anyway.
The converter needs its own gguf-py (first on the path), torch, numpy, safetensors and transformers.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

PRE_TOKENIZER = "gpt-2"
PLACEHOLDER_MERGE = "Ā Ā"  # byte-level spellings of 0x00 0x00


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    llama_cpp = Path(argv[0]).resolve()
    script = llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"{script}: not found (LLAMA_CPP_DIR is the llama.cpp source directory)")
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import gguf  # its gguf-py
    from conversion.base import TextModel  # the converter's package, from LLAMA_CPP_DIR

    TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def add_with_a_merge(self: gguf.SpecialVocab, gw: gguf.GGUFWriter, quiet: bool = False) -> None:
        if self.load_merges and not self.merges:
            self.merges = [PLACEHOLDER_MERGE]
        add_to_gguf(self, gw, quiet)

    gguf.SpecialVocab.add_to_gguf = add_with_a_merge
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
