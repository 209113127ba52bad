"""Finding, claiming and clearing partial files in a target's directory.

Every fetch writes its own partial file, named for its node and its owner
(process + nonce, see ``naming.Owner``).  To resume, a fetcher *claims* a
partial left by a dead owner of the same node by renaming it to its own
name: rename is atomic, so when several fetchers race for one leftover
exactly one gets it and the rest find it gone.  A partial whose owner still
runs is never touched (renaming it would not stop that process writing into
it), and another node's partials are that node's business.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent import procident
from llmgw.agent.fetch import naming
from llmgw.agent.fetch.durable import remove

log = logging.getLogger(__name__)


def boot8() -> str:
    return procident.boot_id().replace("-", "")[:8]


# Nonces of the fetches this process is running now.  A partial of this very
# process is in use only while its fetch runs: one left by a fetch that gave
# up (a stall, a dropped connection) is a leftover like any other.
ACTIVE: set[str] = set()


def owner_alive(owner: naming.Owner) -> bool:
    if owner.boot != boot8():
        return False
    if owner.pid == os.getpid():
        mine = me("")
        if (owner.pid, owner.start_time) == (mine.pid, mine.start_time):
            return owner.nonce in ACTIVE
    return procident.is_same_process(procident.ProcessIdentity(owner.pid, owner.start_time, procident.boot_id()))


def me(nonce: str) -> naming.Owner:
    ident = procident.identify(os.getpid())
    start = ident.start_time if ident is not None else 0
    return naming.Owner(os.getpid(), start, boot8(), nonce)


@dataclass(frozen=True)
class Leftover:
    path: Path
    size: int


def leftovers(directory: Path, file_name: str, node_id: str) -> list[Leftover]:
    """This node's partials for ``file_name`` whose owners are dead, largest first."""
    out = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        parsed = naming.parse_partial(name, file_name)
        if parsed is None or parsed[0] != node_id or owner_alive(parsed[1]):
            continue
        try:
            out.append(Leftover(directory / name, os.stat(directory / name).st_size))
        except FileNotFoundError:
            continue
    return sorted(out, key=lambda x: -x.size)


def claim(directory: Path, file_name: str, node_id: str, mine: Path) -> Path | None:
    """Take over the largest dead leftover as ``mine`` (with its sidecar); remove the other dead ones.

    Returns the sidecar path the claimed partial's metadata now lives at,
    or None when nothing was claimed.
    """
    claimed = None
    for lo in leftovers(directory, file_name, node_id):
        old_meta = lo.path.with_name(naming.meta_name(lo.path.name))
        if claimed is None:
            try:
                os.rename(lo.path, mine)
            except FileNotFoundError:  # another fetcher claimed it first
                continue
            new_meta = mine.with_name(naming.meta_name(mine.name))
            try:
                os.rename(old_meta, new_meta)
            except FileNotFoundError:
                pass  # no sidecar: no validator, so resume_offset says start over
            log.info("resuming %s from %d bytes left by a previous fetch (%s)", file_name, lo.size, lo.path.name)
            claimed = new_meta
        else:
            log.info("removing stale partial %s", lo.path)
            remove(lo.path, old_meta)  # racing a claimer is harmless: one of us finds it gone
    return claimed


def sweep_orphans(directory: Path, file_name: str, node_id: str) -> None:
    """Remove this node's leftovers for ``file_name`` that no live fetch will use.

    * a sidecar whose partial is gone (claimed elsewhere, or removed after a failure);
    * a sidecar's tmp file (``durable.write_text``) whose writer is dead: a fetcher
      killed between creating it and renaming it;
    * a verified stamp's tmp file whose writer is dead (stamps are written under
      the per-file lock, so a tmp of this very process is a leftover too).
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    prefix = f".{file_name}.{node_id}."
    stamp = naming.verified_name(file_name)
    for name in names:
        if name.startswith(prefix) and name.endswith(naming.META_SUFFIX):
            parsed = naming.parse_partial(_partial_of(name), file_name)
            if parsed and not (directory / _partial_of(name)).exists() and not owner_alive(parsed[1]):
                remove(directory / name)
            continue
        tmp = naming.parse_tmp(name)
        if tmp is None:
            continue
        of, pid = tmp
        if of.startswith(prefix) and of.endswith(naming.META_SUFFIX):
            parsed = naming.parse_partial(_partial_of(of), file_name)
            if parsed and not owner_alive(parsed[1]):
                log.info("removing %s, left by a fetcher that died while writing it", name)
                remove(directory / name)
        elif of == stamp and (pid == os.getpid() or not _pid_alive(pid)):
            remove(directory / name)


def _partial_of(meta: str) -> str:
    return meta[: -len(naming.META_SUFFIX)] + naming.PART_SUFFIX


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
