"""Keys made and revoked by ``llmgw ctl keys`` in a router's keys file, and their usage record, through a real
router and the official openai client."""

from __future__ import annotations

import csv
import io
import signal
import stat
import subprocess
import sys

import openai
import pytest

from llmgw.ctl.keys import main as keys_main
from router_support import RouterProcess, openai_client, router_doc
from simproc import start_sim
from tests.support.polling import until

pytestmark = pytest.mark.integration

# Long enough to fill prefix-cache blocks: the second request finds the first one's blocks cached,
# and the simulator (as vLLM with --enable-prompt-tokens-details) says how many tokens in its usage.
MSG = [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}]


def ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "keys", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def sims():
    started = [start_sim(model="m", extra_args=["--enable-prompt-tokens-details"], timeout=120)]
    yield started
    for s in started:
        s.stop()


def test_a_created_key_serves_is_billed_and_once_revoked_is_refused_after_sighup(sims, tmp_path):
    """The key printed once by the real command line, only its digest on disk; a revoke in force on SIGHUP
    across two workers; the usage record, summed by ``ctl keys usage``, says what the engine reported."""
    keys = tmp_path / "keys.yaml"
    made = ctl("create", "team-a", "--file", str(keys), "--models", "m", "--requests-per-minute", "50")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("sk-llmgw-") and "\n" not in key
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600 and key not in keys.read_text()

    usage_log = tmp_path / "usage.jsonl"
    doc = router_doc([{"id": "sim0", "model": "m", "url": sims[0].url}], allow_unauthenticated=False,
                     api_keys_file="keys.yaml", usage_log=str(usage_log))  # keys file relative: beside router.yaml
    with RouterProcess(doc, workers=2, tmp=tmp_path) as r:
        client = openai_client(r, key)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MSG, max_tokens=2)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-ratelimit-limit-requests"] == "50"  # the limits given to create are in force
        used = [raw.parse().usage]
        stream = client.chat.completions.create(model="m", messages=MSG, max_tokens=3, stream=True,
                                                stream_options={"include_usage": True})
        used += [c.usage for c in stream if c.usage is not None]

        assert keys_main(["keys", "revoke", "team-a", "--file", str(keys)]) == 0  # in-process: one CLI start is enough
        r.proc.send_signal(signal.SIGHUP)

        def refused() -> bool:
            try:
                got = openai_client(r, key).chat.completions.create(model="m", messages=MSG, max_tokens=1)
            except openai.AuthenticationError:
                return True
            used.append(got.usage)  # a worker that had not reloaded yet served it: billed like the others
            return False

        until(refused, "the revoked key to be refused")
        assert r.proc.poll() is None
        assert r.stop() == 0  # SIGTERM: each worker appends what it holds of the current minute
        assert key not in r.output()

    # the usage record outlives the router: what the engine reported, the 401s not counted
    assert stat.S_IMODE(usage_log.stat().st_mode) == 0o600
    billed = ctl("usage", "--log", str(usage_log), "--since", "1h", "--format", "csv")
    assert billed.returncode == 0, billed.stderr
    [row] = list(csv.DictReader(io.StringIO(billed.stdout)))
    assert (row["key"], row["model"]) == ("team-a", "m")
    assert int(row["requests"]) == len(used) >= 2
    assert int(row["prompt_tokens"]) == sum(u.prompt_tokens for u in used)
    assert int(row["completion_tokens"]) == sum(u.completion_tokens for u in used)
    # what the engine had cached of the prompt (the second request's, the first one's blocks)
    cached = [u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in used]
    assert cached[0] == 0 and cached[1] > 0, used
    assert int(row["cached_prompt_tokens"]) == sum(cached)
