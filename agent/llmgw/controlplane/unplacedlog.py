"""Why slots wait, logged one line per deployment and reason when it changes, not one per slot.

A fleet coming up has thousands of slots waiting for the same reason; a
line each, on every pass whose reason text moved, is megabytes of log a
minute and CPU the control plane needs for its agents.
"""

from __future__ import annotations

import logging

log = logging.getLogger("llmgw.controlplane")


class UnplacedLog:
    def __init__(self) -> None:
        self._last: dict[tuple[str, str], list[int]] = {}

    def log(self, unplaced: dict[tuple[str, int], str]) -> None:
        grouped: dict[tuple[str, str], list[int]] = {}
        for (key, slot), why in unplaced.items():
            if not why.startswith("restarting in"):  # the failure was logged; the countdown is in ctl
                grouped.setdefault((key, why), []).append(slot)
        for (key, why), slots in grouped.items():
            if self._last.get((key, why)) != slots:
                shown = ", ".join(f"#{n}" for n in slots[:5]) + (f" and {len(slots) - 5} more" if len(slots) > 5 else "")
                log.warning("%s: %d replica(s) not placed, slot(s) %s: %s", key, len(slots), shown, why)
        self._last = grouped
