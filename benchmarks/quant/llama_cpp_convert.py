"""Run llama.cpp's own `convert_hf_to_gguf.py` on a checkpoint whose tokenizer it does not know.

llama.cpp's converter names a byte-level BPE tokenizer's pre-tokenizer by hashing
how the tokenizer splits one test string, and refuses a hash it has no entry for.
carpool's tokenizers (the built-in model's and the tests') are trained here with
`tokenizers`' ByteLevel pre-tokenizer, whose split is GPT-2's regex, which llama.cpp
calls "gpt-2". This wrapper answers "gpt-2" only where the converter's own table
has no entry, and otherwise runs the converter unchanged, so the file is the one
llama.cpp's tool writes. Run in a separate process (it must import the converter's
own gguf-py, not the installed `gguf`):

    python3 -m benchmarks.quant.llama_cpp_convert LLAMA_CPP_DIR MODEL_DIR \\
        --outfile X.gguf --outtype f32
"""

from __future__ import annotations

import sys
from pathlib import Path

GPT2_PRE_TOKENIZER = "gpt-2"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__)
        return 2
    llama_cpp_dir = Path(argv.pop(0)).resolve()
    sys.path.insert(0, str(llama_cpp_dir / "gguf-py"))
    sys.path.insert(0, str(llama_cpp_dir))
    if "gguf" in sys.modules:
        raise RuntimeError("the installed gguf was imported before the converter's own gguf-py")

    import convert_hf_to_gguf
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            # The unknown-hash case only: any other failure of the converter stands.
            print(f"llama_cpp_convert: pre-tokenizer not in llama.cpp's table; "
                  f"declaring {GPT2_PRE_TOKENIZER!r} (ByteLevel = GPT-2's regex)", file=sys.stderr)
            return GPT2_PRE_TOKENIZER

    TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
