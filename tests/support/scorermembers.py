"""What a balancing scorer picks among, without a router: an endpoint's id, model and replica, and its
requests in flight (the shape of ``router.runtime.EndpointRuntime`` that ``router.balancing`` reads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ep:
    model: str
    replica_id: str


@dataclass
class Member:
    id: str
    endpoint: Ep
    outstanding: int = 0
