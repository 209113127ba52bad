"""Whether bytes already on disk may be continued, and what a response allows.

Pure decisions, no I/O, so every branch is tested without a server.

Resuming is only safe when the bytes on disk and the bytes the server is
about to send belong to the same version of the file.  The request says so
with ``If-Range`` (a strong ETag, else Last-Modified): a server that honours
it answers 206 only for the same version and 200 with the whole new body
otherwise.  Servers do not all honour it, so the answer is checked too:
a 206 whose Content-Range does not start where we asked, does not run to the
end, disagrees with the length we recorded, or carries a different ETag is
refused, as is a 416, and the download starts over.  Splicing two versions
yields a file of the right size and the wrong content, which nothing short
of a digest would notice.

The request always starts one byte *before* the end of what is on disk.
That byte is compared with the one on disk (a cheap check that the prefix
still matches), and it makes a partial that is already complete resumable
too: the server confirms the version by answering 206 for the last byte,
rather than the fetcher taking "the size matches" as proof.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Mapping

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Validator:
    etag: str | None = None
    last_modified: str | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> "Validator":
        return cls(headers.get("ETag") or None, headers.get("Last-Modified") or None)

    def if_range(self) -> str | None:
        """The value for If-Range, or None when resuming cannot be made safe.

        RFC 9110 forbids a weak ETag in If-Range (a weak match does not mean
        byte-identical), so a weak one falls back to Last-Modified.
        """
        if self.etag and not self.etag.startswith("W/"):
            return self.etag
        return self.last_modified


@dataclass(frozen=True)
class Meta:
    """What the sidecar of a partial file records (JSON)."""

    url: str
    validator: Validator
    total: int | None
    boot_id: str
    durable: int = 0  # bytes fsync'd: all that survives a power loss

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Meta | None":
        try:
            d = json.loads(text)
            return cls(url=str(d["url"]), validator=Validator(**d["validator"]),
                       total=None if d["total"] is None else int(d["total"]),
                       boot_id=str(d["boot_id"]), durable=int(d.get("durable", 0)))
        except (ValueError, KeyError, TypeError):
            return None


def resume_offset(size_on_disk: int, meta: Meta | None, url: str, boot_id: str) -> int:
    """How many bytes of a partial file can be kept (0: start over).

    After a reboot only the fsync'd prefix is trusted: the page cache that
    held the rest is gone, and the file may have the right length with
    zeros in it.
    """
    if size_on_disk <= 0 or meta is None or meta.url != url or meta.validator.if_range() is None:
        return 0
    if meta.total is not None and size_on_disk > meta.total:
        return 0
    keep = size_on_disk if meta.boot_id == boot_id else min(size_on_disk, meta.durable)
    return max(0, keep)


def request_headers(keep: int, meta: Meta | None) -> tuple[dict[str, str], int | None]:
    """Headers for the next GET and the offset the body will start at (None: whole file).

    Content codings are refused: a range of a gzip body is not a range of the file.
    """
    headers = {"Accept-Encoding": "identity"}
    if keep <= 0 or meta is None or meta.validator.if_range() is None:
        return headers, None
    start = keep - 1  # one byte of overlap, see the module doc
    headers["Range"] = f"bytes={start}-"
    headers["If-Range"] = meta.validator.if_range()  # type: ignore[assignment]
    return headers, start


class Action(str, Enum):
    APPEND = "append"  # 206 as asked: write the body from ``start``
    WHOLE = "whole"  # 200: the body is the whole file; discard what was on disk
    RESTART = "restart"  # discard what is on disk and ask again without a range
    RETRY = "retry"  # transient: try again later from where we are
    FAIL = "fail"  # permanent


@dataclass(frozen=True)
class Decision:
    action: Action
    start: int = 0
    total: int | None = None
    validator: Validator = Validator()
    reason: str = ""


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    if not value:
        return None
    m = _CONTENT_RANGE.match(value)
    if not m:
        return None
    first, last = int(m.group(1)), int(m.group(2))
    total = None if m.group(3) == "*" else int(m.group(3))
    if last < first or (total is not None and last >= total):
        return None
    return first, last, total


def _int(value: str | None) -> int | None:
    try:
        n = int(value) if value is not None else None
    except ValueError:
        return None
    return n if n is not None and n >= 0 else None


def judge(status: int, reason: str, headers: Mapping[str, str], asked_from: int | None,
          meta: Meta | None) -> Decision:
    """What to do with a response to a GET that asked for ``bytes=asked_from-`` (None: no range)."""
    validator = Validator.from_headers(headers)
    if status == 200:
        why = "" if asked_from is None else f"server answered 200 to a range request from byte {asked_from}"
        return Decision(Action.WHOLE, 0, _int(headers.get("Content-Length")), validator, why)
    if status == 206:
        if asked_from is None or meta is None:
            return Decision(Action.RESTART, reason="server answered 206 to a request without a range")
        cr = parse_content_range(headers.get("Content-Range"))
        if cr is None:
            return Decision(Action.RESTART, reason=f"unusable Content-Range {headers.get('Content-Range')!r}")
        first, last, total = cr
        if first != asked_from:
            return Decision(Action.RESTART, reason=f"Content-Range {headers.get('Content-Range')!r} does not "
                                                   f"start at byte {asked_from} as asked")
        if total is None or last != total - 1:
            return Decision(Action.RESTART, reason=f"Content-Range {headers.get('Content-Range')!r} does not "
                                                   "run to the end of a known length")
        if meta.total is not None and total != meta.total:
            return Decision(Action.RESTART, reason=f"length changed from {meta.total} to {total}")
        length = _int(headers.get("Content-Length"))
        if length is not None and length != last - first + 1:
            return Decision(Action.RESTART, reason=f"Content-Length {length} disagrees with Content-Range "
                                                   f"{headers.get('Content-Range')!r}")
        old = meta.validator
        if validator.etag and old.etag and validator.etag != old.etag:
            return Decision(Action.RESTART, reason=f"ETag changed from {old.etag} to {validator.etag}")
        if (not old.etag and old.last_modified and validator.last_modified
                and validator.last_modified != old.last_modified):
            return Decision(Action.RESTART, reason=f"Last-Modified changed from {old.last_modified} "
                                                   f"to {validator.last_modified}")
        keep_validator = Validator(validator.etag or old.etag, validator.last_modified or old.last_modified)
        return Decision(Action.APPEND, first, total, keep_validator)
    if status == 416:
        return Decision(Action.RESTART, reason=f"server answered 416 (range not satisfiable) from byte {asked_from}")
    if status in RETRYABLE_STATUS:
        return Decision(Action.RETRY, reason=f"HTTP {status} {reason}".rstrip())
    return Decision(Action.FAIL, reason=f"HTTP {status} {reason}".rstrip())
