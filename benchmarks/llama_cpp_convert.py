"""Convert an llmserve built-in checkpoint to GGUF with llama.cpp's convert_hf_to_gguf.py (for
benchmarks/batch1_decode.py; run by benchmarks/llama_cpp.sh).

The built-in models' tokenizer is a byte-level BPE trained locally, which llama.cpp's converter does not
recognise (it identifies pre-tokenizers by the hash of a test encoding). llama-bench never tokenizes text,
so the vocabulary is written as GPT-2-style BPE with the default pre-tokenizer; the weights, what the
benchmark measures, are converted unchanged.

    python benchmarks/llama_cpp_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf bf16|q8_0
"""

from __future__ import annotations

import sys


def main() -> None:
    llama_cpp_dir, model_dir, out, outtype = sys.argv[1:5]
    sys.path.insert(0, llama_cpp_dir)
    import convert_hf_to_gguf
    from conversion.base import TextModel
    from conversion.llama import LlamaModel

    LlamaModel.set_vocab = TextModel._set_vocab_gpt2
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", outtype, "--outfile", out]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
