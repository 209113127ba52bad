"""A shard spec as the control plane sends it on the agent stream (no tests here)."""

from __future__ import annotations


SPEC = {
    "shard_id": "m.p.1-ab/r0", "replica_id": "m.p.1-ab",
    "model": {"name": "m", "source": "org/m", "served_name": "m"},
    "profile": {"name": "p", "engine": "vllm", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                "nodes": 1, "extra_args": [], "env": {}, "start_timeout": 60},
    "rank": 0, "nnodes": 1, "gpu_indices": [0], "env": {},
}
