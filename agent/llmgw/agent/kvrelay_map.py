"""One replica's engine block hashes mapped to route keys, fed by decoded KV events.

The engine names a block by its own hash; a ``BlockRemoved`` carries only that hash, so the
relay keeps what each hash stood for (its route key, ``llmgw.kvroutekeys``) until the engine
evicts it. A ``BlockStored`` names its parent by the engine's hash too: the parent's route key
comes from this map, and blocks whose parent the map does not hold (published before the relay
subscribed, beyond what the replay socket kept) cannot be keyed and are counted, not guessed.

Changes go to a sink (``add``, ``remove``, ``reset``) as route keys appear and disappear: one
route key can stand behind several engine hashes (the same block on two media), so it is added
on its first holder and removed with its last.

The map is bounded (``max_blocks``): an engine cannot make the agent hold more than that for
it; past the bound the map starts over with a reset, which costs routing precision, never
memory.

Pure logic: no sockets, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from llmgw.kvevents import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from llmgw.kvroutekeys import block_key

DEFAULT_MAX_BLOCKS = 1 << 18  # 262,144 blocks: 4.2 M tokens at 16 per block, a few tens of MB here


class Sink(Protocol):
    def add(self, key: int) -> None: ...
    def remove(self, key: int) -> None: ...
    def reset(self) -> None: ...


@dataclass
class MapCounts:
    stored: int = 0  # blocks keyed
    removed: int = 0  # blocks forgotten on BlockRemoved
    orphans: int = 0  # blocks whose parent was unknown: not keyed
    malformed: int = 0  # BlockStored whose token ids do not fill its blocks
    resets: int = 0


def cache_salt(extra: object, lora_name: str | None) -> str | None:
    """The cache salt in a first block's extra keys: vLLM appends it, a string, last."""
    if isinstance(extra, (tuple, list)) and extra and isinstance(extra[-1], str) and extra[-1] != lora_name:
        return extra[-1]
    return None


class RouteMap:
    def __init__(self, sink: Sink, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.sink = sink
        self.max_blocks = max_blocks
        self._blocks: dict[BlockHash, list[int]] = {}  # engine hash -> [route key, holders]
        self._routes: dict[int, int] = {}  # route key -> engine hashes standing for it
        self.counts = MapCounts()

    def __len__(self) -> int:
        return len(self._routes)

    def keys(self) -> list[int]:
        """Every route key held now (for a full resend)."""
        return list(self._routes)

    def reset(self) -> None:
        """Forget everything, and tell the sink so."""
        self._blocks.clear()
        self._routes.clear()
        self.counts.resets += 1
        self.sink.reset()

    def apply(self, events: Sequence[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._removed(h)
            elif isinstance(ev, AllBlocksCleared):
                self.reset()
            # UnknownEvent: a newer engine's event type; nothing here depends on it

    def _stored(self, ev: BlockStored) -> None:
        bs = ev.block_size
        if len(ev.token_ids) != bs * len(ev.block_hashes):
            self.counts.malformed += 1
            return
        if ev.parent_block_hash is None:
            parent: int | None = None
        else:
            held = self._blocks.get(ev.parent_block_hash)
            if held is None:
                self.counts.orphans += len(ev.block_hashes)
                return
            parent = held[0]
        extras = ev.extra_keys or ()
        for i, h in enumerate(ev.block_hashes):
            salt = cache_salt(extras[0] if extras else None, ev.lora_name) if parent is None and i == 0 else None
            key = block_key(parent, ev.token_ids[i * bs:(i + 1) * bs], ev.lora_name, salt)
            self._hold(h, key)
            parent = key

    def _hold(self, h: BlockHash, key: int) -> None:
        held = self._blocks.get(h)
        if held is not None:
            held[1] += 1
            return
        if len(self._blocks) >= self.max_blocks:
            self.reset()
        self._blocks[h] = [key, 1]
        self.counts.stored += 1
        n = self._routes.get(key, 0)
        self._routes[key] = n + 1
        if n == 0:
            self.sink.add(key)

    def _removed(self, h: BlockHash) -> None:
        held = self._blocks.get(h)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del self._blocks[h]
        self.counts.removed += 1
        key = held[0]
        n = self._routes[key] - 1
        if n:
            self._routes[key] = n
        else:
            del self._routes[key]
            self.sink.remove(key)
