"""The fleet's private CA, certificate issuing, SSL contexts and peer identity.

Every connection in the fleet is mutual TLS against one private CA: the
control plane proves its address with a server certificate, each node proves
its node id with a client certificate, operators prove they are operators.  A revocation list refuses certificates
the CA signed but the operator no longer trusts (a leaked or replaced key).
"""

from .ca import CAError, CAExistsError, CertificateAuthority, init_ca, load_ca
from .context import PeerRefused, TLSConfigError, client_context, control_plane_context, server_context
from .identity import (
    IdentityError,
    PeerIdentity,
    certificate_role,
    check_admin_identity,
    check_node_identity,
    check_router_identity,
    check_server_identity,
    peer_identity,
)
from .revocation import (
    RevocationError,
    RevocationList,
    Revocations,
    RevokedError,
    add_revocations,
    load_revocations,
    parse_revocations,
)
from .issue import (
    NODE_ID_MAX_LENGTH,
    NODE_ID_PATTERN,
    IssueError,
    issue_admin,
    issue_node,
    issue_router,
    issue_server,
    sign_csr,
    validate_node_id,
)

__all__ = [
    "CAError",
    "CAExistsError",
    "CertificateAuthority",
    "IdentityError",
    "IssueError",
    "NODE_ID_MAX_LENGTH",
    "NODE_ID_PATTERN",
    "PeerIdentity",
    "PeerRefused",
    "RevocationError",
    "RevocationList",
    "Revocations",
    "RevokedError",
    "add_revocations",
    "check_server_identity",
    "control_plane_context",
    "load_revocations",
    "parse_revocations",
    "TLSConfigError",
    "certificate_role",
    "check_admin_identity",
    "check_node_identity",
    "check_router_identity",
    "client_context",
    "init_ca",
    "issue_admin",
    "issue_node",
    "issue_router",
    "issue_server",
    "load_ca",
    "peer_identity",
    "server_context",
    "sign_csr",
    "validate_node_id",
]
