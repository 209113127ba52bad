# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
name: llmgw
short_description: The live llmgw fleet (nodes, shards, replicas) from the control plane's admin API
version_added: 0.1.0
description:
  - Reads the nodes, replicas and catalog that an llmgw control plane knows about, over its admin API, and turns
    them into an inventory. The declared fleet lives in the static inventory; this plugin brings back the dynamic
    state, so that C(ansible-inventory) answers what runs where and C(playbooks/drift.yml) compares the two.
  - Hosts are the registered nodes, named by their node id, which is the inventory host name of the static
    inventory. Using both sources (C(-i inventory/FLEET -i inventory/FLEET/llmgw.yml)) merges declared and live
    variables on one host.
  - Every variable it sets starts with C(llmgw_live_). Per host, C(llmgw_live_state), C(llmgw_live_agent_version),
    C(llmgw_live_certificate) (the certificate the agent presented to the control plane), a summary of the GPUs
    (see O(gpu_detail)), C(llmgw_live_fabrics), C(llmgw_live_shards) (a rank 0 with its C(endpoint) and
    C(clear_text), true when routers reach that engine over plain HTTP) and more; on the C(all) group,
    C(llmgw_live_fleet), a summary whose size does not grow with the fleet's (the control plane, node counts by
    state, and for each deployment of the live catalog, keyed C(MODEL/PROFILE), its replica count, how many are
    Ready, the replicas that are not, the unplaced slots and, for a deployment short of Ready replicas, the placement
    explanation).
  - "An autoscaled deployment's entry in C(llmgw_live_fleet.deployments) also has C(autoscale), the block as the
    control plane's catalog holds it (C(min), C(max), C(target) and the rest, defaults filled in); C(current), the
    replicas it runs (draining and stopping ones aside); C(desired), the count the autoscaler decided and the
    reconciler places (after the fleet GPU budget, when there is one); C(reason), why the count is what it is
    (the autoscaler's reason as C(ctl explain) shows it, for example C(start), C(stable), C(panic), C(cooldown), C(min),
    C(lent) while a sleeping deployment's GPUs are lent to another);
    C(wanted), what the signal asked for before damping and bounds; and with a budget C(budget) (C(desired),
    C(granted), C(reason)). There C(replicas) is only the count it started from. Query them with
    C(ansible-inventory --host NODE) or C(--list), e.g. C(llmgw_live_fleet.deployments['qwen-7b/vllm-tp1'].desired)."
  - Host variables are kept compact because C(ansible-inventory --list) prints every host's variables, including a
    copy of the C(all) group's, and at thousands of nodes printing them is most of its time. Keys the API left
    empty are left out of a shard.
  - "Groups: C(llmgw_live) (every registered node), C(llmgw_live_certified) (nodes whose agent presented a client
    certificate to the control plane, which C(playbooks/drift.yml) need not read from the node),
    C(llmgw_state_STATE) (C(ready), C(unreachable), C(lost)),
    C(llmgw_model_MODEL) (nodes holding a live shard of the model) and C(llmgw_fabric_FABRIC) (nodes advertising
    the fabric). Characters other than letters, digits and C(_) in a name become C(_)."
  - Everything read from the API stays untrusted (shown as C(__ansible_unsafe) by C(ansible-inventory --list)),
    so a string a node reports is never templated.
  - When the control plane cannot be reached or refuses the credentials, parsing fails naming the URL and the
    reason. Set C(ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED=true) (or C(any_unparsed_is_failed) in the
    C([inventory]) section of C(ansible.cfg)) so such a failure stops the command instead of being a warning.
  - The configuration file must be named C(llmgw.yml) or end in C(.llmgw.yml).
author:
  - llmgw maintainers (!UNKNOWN)
requirements:
  - httpx
extends_documentation_fragment:
  - ansible.builtin.constructed
  - ansible.builtin.inventory_cache
options:
  plugin:
    description: The name of this plugin; it marks the file as this plugin's configuration.
    required: true
    choices: [llmgw.fleet.llmgw]
    type: str
  url:
    description:
      - Base URL of the control plane's API, for example C(https://cp.example:8443).
      - C(http://) is accepted only for a control plane running without TLS.
    type: str
    required: true
    env:
      - name: LLMGW_URL
  ca_path:
    description:
      - The fleet CA certificate that signed the control plane's server certificate.
      - Without it the system's trust store is used.
    type: path
    env:
      - name: LLMGW_CA
  client_cert:
    description: An admin client certificate (PEM), issued by the fleet CA with role C(admin). Needs O(client_key).
    type: path
    env:
      - name: LLMGW_CERT
  client_key:
    description: The private key of O(client_cert).
    type: path
    env:
      - name: LLMGW_KEY
  token:
    description:
      - An admin bearer token, as an alternative to (or together with) the admin certificate.
      - Keep it out of the configuration file; the environment variable or a vault is the place for it.
    type: str
    env:
      - name: LLMGW_TOKEN
  validate_certs:
    description: Verify the control plane's certificate and host name. Turn off only to diagnose.
    type: bool
    default: true
    env:
      - name: LLMGW_VALIDATE_CERTS
  timeout:
    description: Seconds to wait for each API request.
    type: float
    default: 30
    env:
      - name: LLMGW_TIMEOUT
  group_by:
    description: Which built-in groups to create.
    type: list
    elements: str
    choices: [state, model, fabric]
    default: [state, model, fabric]
  gpu_detail:
    description:
      - How much of each node's GPUs goes into its host variables.
      - V(summary) sets C(llmgw_live_gpus_total), C(llmgw_live_gpus_free), C(llmgw_live_gpu_names) (the distinct
        GPU names, usually one) and C(llmgw_live_gpu_memory_bytes) (the memory of all the node's GPUs added up).
        Which GPUs a shard holds is in the shard's C(gpus). Also set, always, C(llmgw_live_gpu_topology), every GPU pair's
        tier as C(nvidia-smi topo -m) shows it (C(gpus), C(tier) NV/PIX/PXB/PHB/NODE/SYS or null when unknown,
        C(nvlinks), C(reason)), null when the node did not discover it; and C(llmgw_live_adapters), each RDMA
        adapter's C(name), C(pci_bus_id), C(numa_node) and C(node_guid).
      - V(full) also sets C(llmgw_live_gpus), one entry per GPU (C(index), C(name), C(memory_bytes), C(uuid) and
        the C(shard) holding it, C(REPLICA/rRANK), its C(numa_node) and C(cpu_affinity), null when unknown). Every GPU
        adds eight values to its host, and C(ansible-inventory
        --list) pays for each; with 4 GPUs a node it takes about 1.5 times as long as with V(summary).
    type: str
    choices: [summary, full]
    default: summary
  page_size:
    description:
      - Nodes, and replicas, per request when reading C(/v1/nodes) and C(/v1/replicas). The control plane builds each
        answer in one go on the event loop that also answers its agents' heartbeats, so a large fleet is read in pages
        (C(?limit=N&after=ID)) rather than in one answer of about 4 kB a node (43 MB at 10,000 nodes), and as much
        for the replicas of 40,000 shards.
      - V(0) reads the list in one request. A control plane older than pages answers the whole list to the first
        request whatever the size, and the plugin takes it as it is.
    type: int
    default: 1000
    env:
      - name: LLMGW_PAGE_SIZE
  explain:
    description:
      - For each deployment of the live catalog with fewer Ready replicas than it asks for, read the placement
        explanation (C(/v1/explain/MODEL)) into C(llmgw_live_fleet). One more request per such model.
    type: bool
    default: true
"""

EXAMPLES = r"""
# inventory/production/llmgw.yml, credentials from LLMGW_URL, LLMGW_CA, LLMGW_CERT, LLMGW_KEY (or LLMGW_TOKEN)
plugin: llmgw.fleet.llmgw

# Everything in the file, plus a group of nodes with a free GPU and a variable for the Ready shard count
plugin: llmgw.fleet.llmgw
url: https://cp.example:8443
ca_path: ~/.local/share/llmgw/pki/ca.crt
client_cert: ~/.local/share/llmgw/pki/admin.crt
client_key: ~/.local/share/llmgw/pki/admin.key
strict: true
gpu_detail: full
compose:
  llmgw_live_ready_shards: llmgw_live_shards | selectattr('state', 'eq', 'ready') | list | length
groups:
  has_free_gpu: llmgw_live_gpus_free > 0
keyed_groups:
  - key: llmgw_live_agent_version
    prefix: agent
cache: true
cache_plugin: ansible.builtin.jsonfile
cache_connection: ~/.cache/llmgw-inventory
cache_timeout: 60
"""

import contextlib
import gc
import logging
import os
import re
import ssl

from ansible.errors import AnsibleParserError
from ansible.module_utils.basic import missing_required_lib
from ansible.plugins.inventory import BaseInventoryPlugin, Cacheable, Constructable
from ansible_collections.llmgw.fleet.plugins.module_utils.fleet_states import REPLICA_READY
from ansible_collections.llmgw.fleet.plugins.module_utils.shard_states import ENDED_STATES as ENDED_SHARD_STATES

try:
    import httpx
except ImportError as exc:  # reported when the plugin runs, not when Ansible lists it
    httpx = None
    HTTPX_IMPORT_ERROR = exc
else:
    HTTPX_IMPORT_ERROR = None
    # httpx logs every request at INFO; on a controller whose root logger is
    # configured that would interleave with ansible-inventory's own output.
    logging.getLogger("httpx").setLevel(logging.WARNING)

PREFIX = "llmgw_live_"
MAX_PAGE_SIZE = 10000  # the control plane's own limit
_UNSAFE_GROUP_CHARS = re.compile(r"[^A-Za-z0-9_]")


def group_name(kind, value):
    """``llmgw_KIND_VALUE`` with anything but letters, digits and ``_`` made ``_``."""
    return _UNSAFE_GROUP_CHARS.sub("_", "llmgw_%s_%s" % (kind, value))


def _error_text(response):
    """The API's own ``error`` field when it gave one, else the start of the body."""
    try:
        doc = response.json()
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("error"):
        return str(doc["error"])
    return response.text[:200].strip() or response.reason_phrase


class InventoryModule(BaseInventoryPlugin, Constructable, Cacheable):
    NAME = "llmgw.fleet.llmgw"

    def verify_file(self, path):
        if not super(InventoryModule, self).verify_file(path):
            return False
        name = os.path.basename(path)
        return name in ("llmgw.yml", "llmgw.yaml") or name.endswith((".llmgw.yml", ".llmgw.yaml"))

    # ------------------------------------------------------------------ options
    def _validated_options(self):
        """The connection options, checked before anything is requested."""
        url = (self.get_option("url") or "").rstrip("/")
        if not re.match(r"^https?://[^/]+", url):
            raise AnsibleParserError("llmgw inventory: url must be http(s)://HOST[:PORT], got %r (set url or LLMGW_URL)" % url)
        cert, key = self.get_option("client_cert"), self.get_option("client_key")
        token = self.get_option("token")
        if bool(cert) != bool(key):
            raise AnsibleParserError("llmgw inventory: client_cert and client_key go together (LLMGW_CERT / LLMGW_KEY); only %s is set"
                                     % ("client_cert" if cert else "client_key"))
        for option in ("ca_path", "client_cert", "client_key"):
            value = self.get_option(option)
            if value and not os.access(value, os.R_OK):
                raise AnsibleParserError("llmgw inventory: %s %s cannot be read" % (option, value))
        if url.startswith("https://") and not cert and not token:
            raise AnsibleParserError("llmgw inventory: %s needs an admin certificate (client_cert/client_key, LLMGW_CERT/LLMGW_KEY) "
                                     "or an admin token (token, LLMGW_TOKEN)" % url)
        page_size = self.get_option("page_size")
        if page_size is None or not 0 <= page_size <= MAX_PAGE_SIZE:
            raise AnsibleParserError("llmgw inventory: page_size must be a whole number from 0 (no pages) to %d, got %r"
                                     % (MAX_PAGE_SIZE, page_size))
        timeout = self.get_option("timeout")
        if timeout is None or timeout <= 0:
            raise AnsibleParserError("llmgw inventory: timeout must be a positive number of seconds, got %r" % timeout)
        return url

    def _client(self, url):
        headers = {"Accept": "application/json"}
        token = self.get_option("token")
        if token:
            headers["Authorization"] = "Bearer %s" % token.strip()
        verify = True
        if url.startswith("https://"):
            ctx = ssl.create_default_context(cafile=self.get_option("ca_path") or None)
            if not self.get_option("validate_certs"):
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if self.get_option("client_cert"):
                try:
                    ctx.load_cert_chain(self.get_option("client_cert"), self.get_option("client_key"))
                except (OSError, ssl.SSLError) as e:
                    raise AnsibleParserError("llmgw inventory: cannot load the admin certificate %s with key %s: %s"
                                             % (self.get_option("client_cert"), self.get_option("client_key"), e))
            verify = ctx
        return httpx.Client(base_url=url, verify=verify, headers=headers, timeout=self.get_option("timeout"))

    # -------------------------------------------------------------------- fetch
    def _get(self, client, url, path, params=None):
        where = url + path
        try:
            response = client.get(path, params=params)
        except httpx.HTTPError as e:
            reason = str(e) or type(e).__name__
            raise AnsibleParserError("llmgw inventory: the control plane at %s did not answer: %s" % (where, reason))
        if response.status_code in (401, 403):
            raise AnsibleParserError("llmgw inventory: the control plane at %s refused the credentials (HTTP %d): %s"
                                     % (where, response.status_code, _error_text(response)))
        if response.status_code != 200:
            raise AnsibleParserError("llmgw inventory: %s answered HTTP %d: %s" % (where, response.status_code, _error_text(response)))
        try:
            doc = response.json()
        except ValueError as e:
            raise AnsibleParserError("llmgw inventory: %s did not answer JSON: %s" % (where, e))
        if not isinstance(doc, dict):
            raise AnsibleParserError("llmgw inventory: %s answered %s, not a JSON object" % (where, type(doc).__name__))
        return doc

    def _fetch(self, url):
        """The API documents the inventory is made from (what the cache holds)."""
        with self._client(url) as client:
            data = {
                "url": url,
                "nodes": self._paged(client, url, "/v1/nodes", "nodes"),
                "replicas": self._paged(client, url, "/v1/replicas", "replicas"),
                "catalog": self._get(client, url, "/v1/catalog"),
                "explain": {},
            }
            for field, kind in (("nodes", list), ("replicas", list)):
                if not isinstance(data[field].get(field), kind):
                    raise AnsibleParserError("llmgw inventory: %s/v1/%s has no %r list: is this an llmgw control plane?" % (url, field, field))
            if self.get_option("explain"):
                ready = _ready_by_deployment(data["replicas"])
                for model in sorted({d["model"] for d in data["catalog"].get("deployments", ())
                                     if ready.get((d["model"], d["profile"]), 0) < _wanted(d)}):
                    data["explain"][model] = self._get(client, url, "/v1/explain/%s" % model)
        return data

    def _paged(self, client, url, path, field):
        """``path`` as one document, read in pages of ``page_size`` elements of ``field`` (each page's ``next`` is
        the key of the one after it; the last has none). The rest of the document is the last page's, the most
        recent."""
        size = self.get_option("page_size")
        if not size:
            return self._get(client, url, path)
        items, after = [], None
        while True:
            params = {"limit": size} if after is None else {"limit": size, "after": after}
            doc = self._get(client, url, path, params)
            if not isinstance(doc.get(field), list):
                return doc  # reported by the caller's check, as for an unpaged answer
            items.extend(doc[field])
            following = doc.get("next")
            if following is None:
                doc[field] = items
                return doc
            if not isinstance(following, str) or (after is not None and following <= after):
                raise AnsibleParserError("llmgw inventory: %s%s answered a page whose next (%r) does not move past "
                                         "its after (%r): is this an llmgw control plane?" % (url, path, following, after))
            after = following

    # ---------------------------------------------------------------- populate
    def _populate(self, data):
        group_by = set(self.get_option("group_by") or ())
        shards_by_node = {}
        for r in data["replicas"]["replicas"]:
            for s in r.get("shards", ()):
                node = s.get("node_id")
                if node:
                    shards_by_node.setdefault(node, []).append(_shard_vars(r, s))

        gpu_detail = self.get_option("gpu_detail")
        inventory = self.inventory
        host_vars_to = _unwrapped(inventory)
        inventory.add_group("llmgw_live")
        inventory.add_group("llmgw_live_certified")
        strict = self.get_option("strict")
        compose, groups, keyed = self.get_option("compose"), self.get_option("groups"), self.get_option("keyed_groups")
        for node in data["nodes"]["nodes"]:
            host = node["node_id"]
            inventory.add_host(host, group="llmgw_live")
            if (node.get("certificate") or {}).get("not_after"):
                inventory.add_child("llmgw_live_certified", host)
            hostvars = _host_vars(node, shards_by_node.get(host, []), gpu_detail)
            for name, value in hostvars.items():
                host_vars_to.set_variable(host, name, value)
            if "state" in group_by:
                inventory.add_child(inventory.add_group(group_name("state", node["state"])), host)
            if "fabric" in group_by:
                for fabric in node.get("fabrics", ()):
                    if fabric.get("advertised_hcas"):
                        inventory.add_child(inventory.add_group(group_name("fabric", fabric["name"])), host)
            if "model" in group_by:
                for model in sorted({s["model"] for s in hostvars[PREFIX + "shards"] if s["state"] not in ENDED_SHARD_STATES}):
                    inventory.add_child(inventory.add_group(group_name("model", model)), host)
            if compose or groups or keyed:
                self._set_composite_vars(compose, hostvars, host, strict=strict)
                self._add_host_to_composed_groups(groups, hostvars, host, strict=strict)
                self._add_host_to_keyed_groups(keyed, hostvars, host, strict=strict)

        inventory.set_variable("all", PREFIX + "fleet", _fleet_vars(data))

    def parse(self, inventory, loader, path, cache=True):
        super(InventoryModule, self).parse(inventory, loader, path)
        self._read_config_data(path)
        if httpx is None:
            raise AnsibleParserError(missing_required_lib("httpx"), orig_exc=HTTPX_IMPORT_ERROR)
        url = self._validated_options()
        with _cyclic_gc_paused():
            self._populate(self._data(path, url, cache))

    def _data(self, path, url, cache):
        """The API documents, from the inventory cache when it is on and allowed, else from the control plane."""
        cache_key = self.get_cache_key(path)
        use_cache = self.get_option("cache")
        read_cache = use_cache and cache
        write_cache = use_cache and not cache
        data = None
        if read_cache:
            try:
                data = self._cache[cache_key]
            except KeyError:
                write_cache = True
        if data is None:
            data = self._fetch(url)
        if write_cache:
            self._cache[cache_key] = data
        return data


def _unwrapped(inventory):
    """The inventory data under ansible-core's proxy, for the per-host variables.

    The proxy hands every value to a visitor that deep-copies it and tags every string, number and container with
    the plugin's origin; at 10,000 nodes of 8 GPUs, skipping it took ``ansible-inventory --graph`` from 6.6 s to 2.0 s
    of CPU and ``--list`` from 16.9 s to 12.7 s. Host variables here are built fresh from decoded JSON
    (dicts, lists, str, int, float, bool, None: the types the visitor admits), never mutated afterwards, and never
    marked trusted, so they stay untrusted (never templated) exactly as through the proxy; what is lost is only the
    origin note on an error about one of these values. The ``all`` group's variable still goes through the proxy."""
    return getattr(inventory, "__wrapped__", inventory)


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Decoding the API answers and building the inventory (ansible-core copies and tags every value it is given)
    make millions of long-lived objects and no garbage cycles; at 10,000 nodes the cyclic collector re-scanning
    them as they piled up was a third of the time spent loading. Reference counting still frees everything."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ----------------------------------------------------------------------- shapes
def _ready_by_deployment(replicas_doc):
    ready = {}
    for r in replicas_doc.get("replicas", ()):
        if r.get("state") == REPLICA_READY:
            key = (r["model"], r["profile"])
            ready[key] = ready.get(key, 0) + 1
    return ready


def _wanted(deployment):
    """The count the control plane places: an autoscaled deployment's decided one, else the declared one."""
    scaling = deployment.get("scaling")
    if isinstance(scaling, dict) and isinstance(scaling.get("desired"), int):
        return scaling["desired"]
    return deployment["replicas"]


def _autoscale_vars(deployment):
    """An autoscaled deployment's bounds (the live catalog's block, defaults filled in) and its counts: ``current``
    (replicas not retired), ``desired`` (the count placed), ``reason`` (the rule's last), ``wanted`` (what the signal asked
    for) and ``budget`` (the fleet GPU budget's grant, with a budget). Nothing for a deployment with a fixed count, or
    from a control plane that predates the view."""
    block, scaling = deployment.get("autoscale"), deployment.get("scaling")
    if not isinstance(block, dict) or not isinstance(scaling, dict):
        return {}
    budget = scaling.get("budget") if isinstance(scaling.get("budget"), dict) else None
    return _compact({
        "autoscale": block,
        "current": scaling.get("current"),
        "desired": scaling.get("desired"),
        "reason": scaling.get("reason"),
        "wanted": scaling.get("wanted"),
        "budget": budget,
    })


def _compact(values):
    """Leave out what the API left empty: at 40,000 shards every key is paid for per host."""
    return dict((k, v) for k, v in values.items() if v is not None)


def _shard_vars(replica, shard):
    """A shard as its replica and rank (the shard id is REPLICA/rRANK)."""
    return _compact({
        "replica_id": replica["replica_id"],
        "model": replica["model"],
        "profile": replica["profile"],
        "rank": shard.get("rank"),
        "state": shard.get("state"),
        "state_for_s": shard.get("state_for_s"),
        "reason": shard.get("reason"),
        "replica_state": replica.get("state"),
        "endpoint": replica.get("endpoint") if shard.get("rank") == 0 else None,
        # true: prompts and the engine key reach this engine in clear text (no TLS: SGLang, no engine_tls)
        "clear_text": replica.get("clear_text") if shard.get("rank") == 0 else None,
        "gpus": shard.get("gpus", []),
        "progress": shard.get("progress"),
    })


def _host_vars(node, shards, gpu_detail):
    hardware = node.get("hardware") or {}
    gpus = node.get("gpus") or []
    values = {
        "state": node.get("state"),
        "state_for_s": node.get("state_for_s"),
        "reason": node.get("reason"),
        "connected": node.get("connected"),
        "last_seen_s": node.get("last_seen_s"),
        "address": node.get("address"),
        "agent_version": node.get("agent_version"),
        "boot_id": node.get("boot_id"),
        "certificate": node.get("certificate"),
        "epoch": node.get("epoch"),
        "registrations": node.get("registrations"),
        "gpus_total": node.get("gpus_total"),
        "gpus_free": node.get("gpus_free"),
        "gpu_names": sorted(set(g["name"] for g in gpus if g.get("name"))),
        "gpu_memory_bytes": sum(g.get("memory_bytes") or 0 for g in gpus),
        "nvlink_known": node.get("nvlink_known"),
        # Every GPU pair's tier as nvidia-smi topo -m shows it; None when the node did not discover it.
        "gpu_topology": (hardware.get("topology") or {}).get("links"),
        "adapters": [dict((k, h.get(k)) for k in ("name", "pci_bus_id", "numa_node", "node_guid"))
                     for h in hardware.get("hcas", [])],
        "fabrics": node.get("fabrics", []),
        "undeclared_hcas": hardware.get("undeclared_hcas", []),
        "shards": sorted(shards, key=lambda s: (s["replica_id"], s.get("rank", 0))),
    }
    if gpu_detail == "full":
        where = dict((g.get("index"), g) for g in hardware.get("gpus", []))
        values["gpus"] = [dict([(k, g.get(k)) for k in ("index", "name", "memory_bytes", "uuid", "shard")]
                               + [(k, where.get(g.get("index"), {}).get(k)) for k in ("numa_node", "cpu_affinity")])
                          for g in gpus]
    return dict((PREFIX + k, v) for k, v in values.items())


def _fleet_vars(data):
    replicas = data["replicas"]
    catalog = data["catalog"]
    by_pair = {}
    for r in replicas.get("replicas", ()):
        by_pair.setdefault((r["model"], r["profile"]), []).append(r)
    unplaced = {}
    for u in replicas.get("unplaced", ()):
        unplaced.setdefault((u["model"], u["profile"]), []).append({"slot": u.get("slot"), "reason": u.get("reason")})
    deployments = {}
    for d in catalog.get("deployments", ()):
        pair = (d["model"], d["profile"])
        mine = by_pair.get(pair, [])
        explain = data["explain"].get(d["model"]) or {}
        label = "%s/%s#" % pair
        entry = {"replicas": d["replicas"], "ready": sum(1 for r in mine if r.get("state") == REPLICA_READY)}
        entry.update(_autoscale_vars(d))
        not_ready = [_compact({"replica_id": r["replica_id"], "state": r.get("state"), "reason": r.get("reason")})
                     for r in mine if r.get("state") != REPLICA_READY]
        explained = [_compact({"replica": e.get("replica"), "placed": e.get("placed"), "reason": e.get("reason"),
                               "held": e.get("held"), "text": e.get("text")})
                     for e in explain.get("replicas", ())
                     if str(e.get("replica", "")).startswith(label) and e.get("state") != REPLICA_READY]
        for key, value in (("not_ready", not_ready), ("unplaced", unplaced.get(pair)), ("explain", explained)):
            if value:
                entry[key] = value
        deployments["%s/%s" % pair] = entry
    states = {}
    for n in data["nodes"]["nodes"]:
        states[n.get("state")] = states.get(n.get("state"), 0) + 1
    fleet = dict(data["nodes"].get("fleet") or {})
    fleet.update({
        "url": data["url"],
        "nodes": len(data["nodes"]["nodes"]),
        "node_states": states,
        "catalog_source": catalog.get("source"),
        "deployments": deployments,
    })
    return fleet
