# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters that turn inventory addresses into certificate subject alternative names.

Hostname verification reads SANs and ignores the common name, so the server
certificate must hold every name and address agents dial, each in the right
kind: an IP literal filed as a DNS name never matches the address being dialed.
The rules are the ones the runtime's issuer applies, so a certificate issued
by the playbook and one issued by ``llmgw ctl cert`` carry the same names.
"""

from __future__ import annotations

import ipaddress
import re

from ansible.errors import AnsibleFilterError

_DNS_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def _ip(value):
    try:
        return ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        return None


def _dns(host):
    if host.endswith("."):
        raise AnsibleFilterError("tls_sans: %r ends with a dot; write it without the trailing dot" % host)
    if "*" in host:
        raise AnsibleFilterError("tls_sans: %r: wildcard names are not issued; list each name" % host)
    lowered = host.lower()
    if len(lowered) > 253 or not all(_DNS_LABEL.match(label) for label in lowered.split(".")):
        raise AnsibleFilterError(
            "tls_sans: %r is neither an IP address nor a valid DNS name "
            "(letters, digits and '-' in dot-separated labels of at most 63 characters)" % host
        )
    return lowered


def tls_sans(hosts):
    """``["cp.example", "10.0.0.5", "::1"]`` -> ``["DNS:cp.example", "IP:10.0.0.5", "IP:::1"]``.

    Names are lowercased, addresses written in their canonical form, duplicates
    dropped with the first occurrence kept; DNS names come before addresses,
    so the first DNS name (the certificate's common name) is the first one listed.
    """
    if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)):
        raise AnsibleFilterError("tls_sans: expected a list of host names and addresses, got %r" % (hosts,))
    names, addresses = [], []
    for host in hosts:
        if not isinstance(host, str) or not host:
            raise AnsibleFilterError("tls_sans: every entry must be a non-empty string, got %r" % (host,))
        if "%" in host:
            raise AnsibleFilterError("tls_sans: %r has a zone index; certificates cannot carry one" % host)
        address = _ip(host)
        if address is None:
            names.append("DNS:" + _dns(host))
        else:
            addresses.append("IP:" + address.compressed)
    sans = list(dict.fromkeys(names + addresses))
    if not sans:
        raise AnsibleFilterError("tls_sans: a server certificate needs at least one name or address")
    return sans


class FilterModule(object):
    """llmgw certificate filters."""

    def filters(self):
        return {"tls_sans": tls_sans}
