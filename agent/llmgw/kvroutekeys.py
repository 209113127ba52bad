"""Route keys: opaque 64-bit digests of KV blocks, the same on the node and in the router.

An engine's own block hashes cannot serve routing: vLLM's depend on a per-process seed
(``PYTHONHASHSEED``) and its hash algorithm setting, and SGLang's differ again, so a router
could not compute them for a request. Route keys are llmgw's own chain, computed by the agent
from the token ids in the engine's ``BlockStored`` events and by the router from a request's
token ids, over the same inputs:

    key(block) = blake2b-64(parent key | extras | token ids of the block)

``parent key`` is the key of the block before it (a fixed root for the first block), so a key
stands for the whole prefix up to and including its block; ``extras`` are what makes the same
tokens a different cache entry (the LoRA adapter's name, the request's ``cache_salt``, which
salts the first block only, as vLLM salts it). Token ids are packed as signed 64-bit
little-endian integers, strings as length-prefixed UTF-8, so no two inputs share an encoding.

Keys travel as 16 lower-case hex digits (JSON numbers lose precision past 2**53). They are
digests, not an encryption: whoever guesses a whole prompt can confirm the guess against a key,
as with any unkeyed hash; what they never carry is the prompt's text or its token ids.

Pure logic, no I/O: imported by the agent's relay and by the router's index.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

ROOT = hashlib.blake2b(b"llmgw-route-key-v1", digest_size=8).digest()  # the first block's parent
_LOW64 = (1 << 64) - 1


def _text(s: str | None) -> bytes:
    raw = (s or "").encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def block_key(parent: int | None, tokens: Sequence[int], lora_name: str | None = None,
              salt: str | None = None) -> int:
    """The route key of one block whose parent block has key ``parent`` (None: a first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(ROOT if parent is None else parent.to_bytes(8, "little"))
    h.update(_text(lora_name))
    h.update(_text(salt))
    h.update(array("q", tokens).tobytes() if tokens else b"")
    return int.from_bytes(h.digest(), "little") & _LOW64


def chain_keys(tokens: Sequence[int], block_size: int, lora_name: str | None = None, salt: str | None = None,
               parent: int | None = None) -> list[int]:
    """Keys of every full block of ``tokens``, chained from ``parent``; the cache salt covers the first
    block of a chain that starts at the root, as the engine's own hashes do."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(tokens) // block_size
    if n == 0:
        return []
    # block_key's bytes, packed once: the per-block hashing is most of a request's index work
    raw = array("q", tokens[:n * block_size]).tobytes()
    step = 8 * block_size
    lora = _text(lora_name)
    first = lora + _text(salt)
    rest = lora + _text(None)
    blake2b = hashlib.blake2b
    out: list[int] = []
    prev = ROOT if parent is None else parent.to_bytes(8, "little")
    extras = first if parent is None else rest
    for i in range(n):
        digest = blake2b(prev + extras + raw[i * step:(i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        prev, extras = digest, rest
    return out


def to_hex(key: int) -> str:
    return f"{key:016x}"


def from_hex(text: str) -> int:
    """A key from its wire form; ``ValueError`` for anything but 16 hex digits."""
    if len(text) != 16:
        raise ValueError(f"a route key is 16 hex digits, got {len(text)} characters")
    return int(text, 16)
