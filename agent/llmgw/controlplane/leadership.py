"""Several control planes (``ha``): the elector, the shared store, and what leading or losing the lead does here.

Taking the lead reads the store again and starts a failover grace
(``ControlPlane.take_over``); a store that cannot be read gives the lead up
rather than lead blind.  Losing it ends the process: the book is from a
term that ended, so it is never kept as a standby's; the service manager
starts a fresh standby.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

from llmgw.controlplane.etcd import AsyncEtcd, BlockingEtcd
from llmgw.controlplane.etcd import tls_context as etcd_tls
from llmgw.controlplane.grantsecret import GrantSecretError
from llmgw.controlplane.leader import Elector
from llmgw.controlplane.standby import DEPOSED_EXIT
from llmgw.controlplane.startup import StartupRefused
from llmgw.controlplane.state import ControlPlane
from llmgw.controlplane.store import ControlPlaneStore, EtcdBackend, StoreError
from llmgw.settings import ServerSettings

log = logging.getLogger("llmgw.controlplane")


class LeaderHooks:
    """Binds ``cp`` to ``elector``: it acts only while leading, and ``stop`` is set when deposed."""

    def __init__(self, cp: ControlPlane, elector: Elector, stop: asyncio.Event):
        self.deposed = False
        self._cp, self._elector, self._stop = cp, elector, stop
        cp.authority = lambda: elector.is_leader
        elector.on_change = self.changed

    def changed(self, leading: bool, epoch: int) -> None:
        if leading:
            try:
                self._cp.take_over(epoch)
            except (StoreError, GrantSecretError) as e:  # cannot read what the last leader wrote: do not lead blind
                log.error("cannot read the store on taking over: %s; giving the lead up", e)
                asyncio.get_running_loop().create_task(self._elector.resign())
            return
        # Never a standby in place: the book is from a term that ended. Exit; the service manager
        # starts a fresh standby.
        log.error("no longer the leader: exiting (status %d) to start again as a standby", DEPOSED_EXIT)
        self.deposed = True
        self._stop.set()


def make_elector(settings: ServerSettings) -> Elector:
    ha = settings.ha
    assert ha is not None
    try:
        tls = etcd_tls(ha.ca, ha.cert, ha.key)
    except (OSError, ssl.SSLError) as e:
        raise StartupRefused(f"ha.etcd: cannot load its TLS files: {e}") from e
    url = ha.advertise_url or f"{'https' if settings.tls else 'http'}://{settings.api_host}:{settings.api_port}"
    return Elector(AsyncEtcd(ha.endpoints, tls, timeout=max(0.5, ha.renew_interval)), ha.prefix,
                   ha.name or socket.gethostname(), url, ha.lease_ttl, ha.renew_interval,
                   max_loop_stall=ha.max_loop_stall)


def ha_store(settings: ServerSettings, elector: Elector) -> ControlPlaneStore:
    """Intent and epochs in etcd, shared by the control planes; every write fenced on leading."""
    ha = settings.ha
    assert ha is not None
    if settings.state_dir is not None:
        log.info("ha: cordons, drains and the epoch are kept in etcd, not in state_dir %s", settings.state_dir)
    client = BlockingEtcd(ha.endpoints, etcd_tls(ha.ca, ha.cert, ha.key), timeout=max(0.5, ha.renew_interval))
    return ControlPlaneStore(EtcdBackend(client, ha.prefix, fence=elector.fence))
