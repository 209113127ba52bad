"""A node certificate that expires while its agent is connected.

TLS checks a certificate's validity only at the handshake; the control plane
closes the stream when the certificate it was opened with expires, and the
agent's next handshake, still presenting it, is refused.  The engines keep
serving: nothing about them depends on the agent's certificate.
"""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509

from llmgw.agent import procident
from llmgw.agent.procident import ProcessIdentity
from llmgw.tls import issue_node
from llmgw.tls.files import write_pair

from fleet import WAIT, Fleet, until

pytestmark = pytest.mark.integration

LIFETIME = 45  # seconds the node certificate is valid after the test starts: room for a slow start


def test_a_node_certificate_expiring_mid_connection_closes_its_stream_and_the_next_handshake_is_refused(tmp_path):
    with Fleet(tmp_path, nodes={"a": 1}, replicas=1) as f:
        node = f.node_ids["a"]
        issued_at = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1) + dt.timedelta(seconds=LIFETIME)
        crt, _ = write_pair(f.pki.dir / f"node-{node}", *issue_node(f.pki.ca, node, days=1, now=issued_at))
        not_after = x509.load_pem_x509_certificate(crt.read_bytes()).not_valid_after_utc
        f.start()
        (rep,) = f.wait_ready(1)
        engine = ProcessIdentity.from_dict(rep["shards"][0]["process"])
        if dt.datetime.now(dt.timezone.utc) >= not_after:
            pytest.skip("the fleet took longer to come up than the certificate lived")
        assert f.nodes()[node]["certificate"]["not_after"] == not_after.isoformat()
        until(lambda: "its client certificate expired" in f.server.output(10 ** 8),
              "the control plane to close the stream at expiry", timeout=LIFETIME + WAIT, on_timeout=f.dump)
        until(lambda: f.nodes()[node]["connected"] is False, "the node disconnected", on_timeout=f.dump)
        until(lambda: "certificate has expired" in f.server.output(10 ** 8).split("its client certificate expired")[-1],
              "the agent's next handshake refused for the expired certificate", on_timeout=f.dump)
        assert f.nodes()[node]["registrations"] == 1, "never registered again with the expired certificate"
        assert procident.is_running(engine), "the engine keeps serving"
        assert f.agents["a"].alive()
