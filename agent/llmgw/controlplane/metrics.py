"""``/metrics``: the fleet as Prometheus sees it, computed at scrape time.

A collector reads the live state on each scrape instead of mirroring it into
gauges, so a node or replica that is gone is gone from the output too.
``llmgw_gpu_nvlink_peers`` is per GPU: a flat zero across a fleet means the
topology is unknown (see ``llmgw_node_nvlink_known``), not absent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.controlplane.lifecycle import NodeState
from llmgw.controlplane.lifecycletimers import ARRIVALS
from llmgw.controlplane.replicas import ReplicaState
from llmgw.controlplane.state import ControlPlane
from llmgw.protocol import ShardState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FleetCollector(Collector):
    def __init__(self, cp: ControlPlane):
        self.cp = cp

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        cp = self.cp
        book = cp.reconciler.book
        node_state = GaugeMetricFamily("llmgw_node_state", "1 for the node's current lifecycle state", labels=["node", "state"])
        connected = GaugeMetricFamily("llmgw_node_connected", "1 while the node's stream is open", labels=["node"])
        gpus = GaugeMetricFamily("llmgw_node_gpus", "GPUs the node reported", labels=["node"])
        free = GaugeMetricFamily("llmgw_node_gpus_free", "GPUs no shard holds", labels=["node"])
        known = GaugeMetricFamily("llmgw_node_nvlink_known", "1 when the node could read its NVLink topology", labels=["node"])
        peers = GaugeMetricFamily("llmgw_gpu_nvlink_peers", "GPUs of the same node this GPU reaches over NVLink",
                                  labels=["node", "gpu"])
        fetching = GaugeMetricFamily("llmgw_node_shards_fetching",
                                     "Shards on the node downloading their weights", labels=["node"])
        for node_id in sorted(cp.nodes):
            rec = cp.nodes[node_id]
            for st in NodeState:
                node_state.add_metric([node_id, st.value], 1.0 if rec.clock.state is st else 0.0)
            connected.add_metric([node_id], 1.0 if rec.connected else 0.0)
            gpus.add_metric([node_id], len(rec.inventory.gpus))
            claimed = book.claimed(node_id)
            free.add_metric([node_id], sum(1 for g in rec.inventory.gpus if g.index not in claimed))
            known.add_metric([node_id], 1.0 if rec.inventory.nvlink_known else 0.0)
            for g in rec.inventory.gpus:
                peers.add_metric([node_id, str(g.index)], len(g.nvlink_peers))
            fetching.add_metric([node_id], sum(1 for s in book.shards_on(node_id)
                                               if s.state == ShardState.FETCHING and not s.released))
        yield from (node_state, connected, gpus, free, known, peers, fetching)

        rstate = GaugeMetricFamily("llmgw_replica_state", "1 for the replica's current state",
                                   labels=["replica", "model", "profile", "state"])
        counts = GaugeMetricFamily("llmgw_replicas", "Replicas by state", labels=["model", "profile", "state"])
        desired = GaugeMetricFamily("llmgw_replicas_desired",
                                    "Replicas the catalog declares (an autoscaled deployment: the count decided)",
                                    labels=["model", "profile"])
        tally: Counter[tuple[str, str, str]] = Counter()
        for r in sorted(book.replicas.values(), key=lambda r: r.replica_id):
            for st in ReplicaState:
                rstate.add_metric([r.replica_id, r.model, r.profile, st.value], 1.0 if r.state is st else 0.0)
            tally[(r.model, r.profile, r.state.value)] += 1
        for dep in cp.catalog.deployments:
            desired.add_metric([dep.model, dep.profile], cp.replica_counts.get(dep.key, dep.replicas))
            for st in ReplicaState:
                tally.setdefault((dep.model, dep.profile, st.value), 0)
        for (m, p, st), n in sorted(tally.items()):
            counts.add_metric([m, p, st], n)
        yield from (rstate, counts, desired)

        scaled = GaugeMetricFamily("llmgw_autoscale_desired_replicas",
                                   "Replicas the autoscaler wants, labelled with why (autoscale.REASONS)",
                                   labels=["model", "profile", "reason"])
        seen = GaugeMetricFamily("llmgw_autoscale_signal",
                                 "The autoscaler's signal: the deployment's total (requests in flight, or its engines' "
                                 "queue depth or KV-cache use summed), averaged per window "
                                 "(stable, panic; ahead: expected one lead time from now, while it rises)",
                                 labels=["model", "profile", "window"])
        lead = GaugeMetricFamily("llmgw_autoscale_lead_seconds",
                                 "A new replica's start as measured (placement to Ready, median of the last starts): "
                                 "how far ahead the autoscaler follows a rising signal", labels=["model", "profile"])
        granted = GaugeMetricFamily("llmgw_autoscale_granted_replicas",
                                    "Replicas the fleet GPU budget grants the deployment (autoscale_budget), "
                                    "labelled with why (autoscale_budget.REASONS)",
                                    labels=["model", "profile", "reason"])
        engine = GaugeMetricFamily("llmgw_autoscale_engine_signal",
                                   "A deployment's engine signal as last sampled: requests waiting in its engines, or "
                                   "their KV-cache use summed (autoscale.signal queue_depth, kv_cache_use); absent "
                                   "while the sample is partial", labels=["model", "profile", "signal"])
        reporting = GaugeMetricFamily("llmgw_autoscale_engine_signal_replicas",
                                      "Ready replicas of a deployment on an engine signal by whether a fresh value "
                                      "of theirs counts (reporting) or not (missing: the count holds)",
                                      labels=["model", "profile", "state"])
        for dep in cp.catalog.deployments:
            sample = cp.autoscaler.sample(dep.key)
            if sample is not None:
                if sample.total is not None:
                    engine.add_metric([dep.model, dep.profile, sample.signal], sample.total)
                reporting.add_metric([dep.model, dep.profile, "reporting"], sample.reporting)
                reporting.add_metric([dep.model, dep.profile, "missing"], sample.replicas - sample.reporting)
            d = cp.autoscaler.decision(dep.key)
            if dep.autoscale is None or d is None:
                continue
            scaled.add_metric([dep.model, dep.profile, d.reason], d.desired)
            if d.stable is not None and d.panic is not None:
                seen.add_metric([dep.model, dep.profile, "stable"], d.stable)
                seen.add_metric([dep.model, dep.profile, "panic"], d.panic)
            if d.ahead is not None:
                seen.add_metric([dep.model, dep.profile, "ahead"], d.ahead)
            if d.lead is not None:
                lead.add_metric([dep.model, dep.profile], d.lead)
            g = cp.autoscaler.grant(dep.key)
            if g is not None:
                granted.add_metric([dep.model, dep.profile, g.reason], g.granted)
        messages = CounterMetricFamily("llmgw_engine_signal_messages", "engine_signals messages applied from agents")
        messages.add_metric([], cp.engine_signals.messages)
        refused = CounterMetricFamily("llmgw_engine_signal_refused",
                                      "engine_signals entries refused: a shard the node does not run as a rank 0")
        refused.add_metric([], cp.engine_signals.refused)
        yield from (scaled, seen, lead, granted, engine, reporting, messages, refused)

        damped = GaugeMetricFamily("llmgw_fleet_damped", "1 while too many nodes are unreachable to declare any lost")
        damped.add_metric([], 1.0 if cp.evaluation.damped else 0.0)
        share = GaugeMetricFamily("llmgw_fleet_unreachable_share", "Share of not-lost nodes that are unreachable")
        share.add_metric([], cp.evaluation.unreachable_share)
        yield from (damped, share)
        keepalive = CounterMetricFamily("llmgw_stream_keepalive_frames",
                                        "WebSocket pings and pongs read from agents' streams (heartbeats stand in "
                                        "for pings with agents that know answers_heartbeats)")
        keepalive.add_metric([], cp.streams.keepalive_frames)
        yield keepalive
        dials = CounterMetricFamily("llmgw_agent_dials",
                                    "Agents' dials by what became of them: registered, admitted, refused (503 and "
                                    "Retry-After), waiting (held unread for a TLS handshake), shed (dropped before "
                                    "one), capped (max_connections_per_source), timed_out (in the handshake)",
                                    labels=["outcome"])
        for outcome in ARRIVALS:
            dials.add_metric([outcome], cp.dials[outcome])
        yield dials

        reports = CounterMetricFamily("llmgw_router_ejection_reports", "Ejection reports received, by router certificate",
                                      labels=["router"])
        for router, n in sorted(cp.ejections.received.items()):
            reports.add_metric([router], n)
        replaced = CounterMetricFamily("llmgw_replicas_replaced", "Replicas judged sick and replaced, by reason",
                                       labels=["reason"])
        replaced.add_metric(["router_ejections"], cp.replaced_for_ejections)
        ejected = GaugeMetricFamily("llmgw_replica_ejected_by_routers", "Routers reporting the replica ejected now",
                                    labels=["replica"])
        for rid, v in sorted(cp.ejection_verdicts.items()):
            ejected.add_metric([rid], len(v.routers))
        yield from (reports, replaced, ejected)


def registry_for(cp: ControlPlane) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(cp))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
