"""A tiny random-weight llama model in GGUF, generated on the spot for real-engine tests.

No hub download and nothing committed: ``write_model(path)`` writes about 0.5 MB
that ``llama-server`` loads in well under a second on CPU (2 layers, 64 wide,
4 heads, a 259-token byte vocabulary with ``tokenizer.ggml.model = llama`` and a
ChatML chat template) and returns its sha256, which the tests put in the catalog
so the weight fetcher's digest check runs against a real engine's file.

The weights are random but shaped for tests: only the rows of printable ASCII
tokens in the output projection are non-zero, so greedy decoding produces valid
UTF-8 text and never the end-of-sequence token (a completion always runs to
``max_tokens`` unless a ``stop`` string ends it). The same seed writes the same
bytes, hence the same digest.

    python tests/engines/tinymodel.py OUT.gguf    # writes the file, prints its sha256
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np

ARCH = "llama"
LAYERS, WIDTH, HEADS, FF, CONTEXT = 2, 64, 4, 128, 2048
SPECIAL = ("<unk>", "<s>", "</s>")
VOCAB = len(SPECIAL) + 256  # 259: three control tokens, then one token per byte
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ones = np.ones(WIDTH, dtype=np.float32)
    out = rand(VOCAB, WIDTH, scale=1.0)
    printable = np.zeros(VOCAB, dtype=bool)
    printable[len(SPECIAL) + 0x20:len(SPECIAL) + 0x7F] = True
    out[~printable] = 0.0  # control and non-ASCII tokens: logit 0, far below the best ASCII one
    t = {"token_embd.weight": rand(VOCAB, WIDTH, scale=1.0), "output_norm.weight": ones, "output.weight": out}
    for i in range(LAYERS):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": ones, p + "ffn_norm.weight": ones,
              p + "attn_q.weight": rand(WIDTH, WIDTH), p + "attn_k.weight": rand(WIDTH, WIDTH),
              p + "attn_v.weight": rand(WIDTH, WIDTH), p + "attn_output.weight": rand(WIDTH, WIDTH),
              p + "ffn_gate.weight": rand(FF, WIDTH), p + "ffn_up.weight": rand(FF, WIDTH),
              p + "ffn_down.weight": rand(WIDTH, FF)}
    return t


def write_model(path: Path, seed: int = 0) -> str:
    """Write the model to ``path`` atomically (temp file, then rename); return its sha256."""
    import gguf

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_name("llmgw-tiny-test")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(WIDTH)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_dimension_count(WIDTH // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list([*SPECIAL, *(f"<0x{b:02X}>" for b in range(256))])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.BYTE] * 256)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, data in _tensors(seed).items():
        w.add_tensor(name, data)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tinymodel.py OUT.gguf")
    print(write_model(Path(sys.argv[1])))
