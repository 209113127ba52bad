"""The simulator's SGLang prefill/decode disaggregation (llmgw.sim.sim_disagg_sglang) without processes:
SGLang's flags, the request's bootstrap fields, the timeouts' variables, and the rooms where a prefill
and its decoder meet, either arriving first, either giving up."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.sim.sim_args import ArgvError, parse_argv
from llmgw.sim.sim_disagg_sglang import (
    DEFAULT_TIMEOUT,
    Bootstrap,
    Claim,
    DisaggError,
    Outcome,
    RoomRefused,
    Rooms,
    SGLangDisagg,
    Timeouts,
    bootstrap_of,
    host_ip,
    timeouts_from_env,
)
from llmgw.sim.sim_http import SimState
from llmgw.sim.sim_knobs import Knobs
from llmgw.sim.sim_metrics import SimMetrics


def sglang(*flags: str):
    return parse_argv(["sglang", "--model-path", "m", *flags])


# ------------------------------------------------------------------------------ flags

def test_mode_null_is_the_default_and_no_side_of_a_pair():
    cfg = sglang()
    assert cfg.disaggregation is None and cfg.enable_prefix_caching
    assert SimState(cfg, Knobs()).pd is None


def test_sglangs_defaults_for_a_prefill_server():
    d = sglang("--disaggregation-mode", "prefill").disaggregation
    assert d is not None and d.prefill
    assert (d.transfer_backend, d.bootstrap_port, d.ib_device) == ("mooncake", 8998, None)


def test_a_decode_server_takes_its_backend_and_devices_and_drops_the_radix_cache():
    cfg = sglang("--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl",
                 "--disaggregation-ib-device", "mlx5_0,mlx5_1")
    d = cfg.disaggregation
    assert d is not None and not d.prefill
    assert (d.transfer_backend, d.ib_device) == ("nixl", "mlx5_0,mlx5_1")
    assert not cfg.enable_prefix_caching  # SGLang: "Radix cache is disabled for decode server"
    assert sglang("--disaggregation-mode", "decode",
                  "--disaggregation-decode-enable-radix-cache").enable_prefix_caching


@pytest.mark.parametrize("flags", [("--disaggregation-mode", "both"),
                                   ("--disaggregation-transfer-backend", "rdma"),
                                   ("--disaggregation-bootstrap-port", "eighty")])
def test_values_sglang_refuses_are_refused(flags):
    with pytest.raises(SystemExit) as e:
        sglang(*flags)
    assert e.value.code == 2


def test_a_prefill_server_cannot_fake_its_transfers():
    with pytest.raises(ArgvError, match="'fake'"):
        sglang("--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake")


# ------------------------------------------------------------------------------ request fields

def test_bootstrap_fields():
    b = bootstrap_of({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7})
    assert b == Bootstrap("10.0.0.1", 8998, 7) and not b.fake and b.missing() == []
    assert bootstrap_of({"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}).fake
    assert bootstrap_of({}).missing() == ["bootstrap_host", "bootstrap_port", "bootstrap_room"]


@pytest.mark.parametrize("fields, says", [
    ({"bootstrap_room": [1, 2]}, "not a list"),
    ({"bootstrap_room": -1}, "bootstrap_room must be a non-negative integer"),
    ({"bootstrap_room": True}, "bootstrap_room must be a non-negative integer"),
    ({"bootstrap_port": "8998"}, "bootstrap_port must be"),
    ({"bootstrap_host": 5}, "bootstrap_host must be a string"),
])
def test_bad_bootstrap_fields_are_a_400_in_sglangs_shape(fields, says):
    with pytest.raises(DisaggError) as e:
        bootstrap_of(fields)
    assert e.value.code == 400 and says in str(e.value)


def test_the_timeouts_are_sglangs_variables_read_as_sglang_reads_them():
    assert timeouts_from_env({}) == Timeouts(DEFAULT_TIMEOUT, DEFAULT_TIMEOUT) == Timeouts(300, 300)
    assert timeouts_from_env({"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "5",
                              "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "7"}) == Timeouts(5, 7)
    # EnvInt: not an integer is the default, with a warning
    assert timeouts_from_env({"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "0.5"}).waiting == 300


def test_the_host_ip_variables():
    assert host_ip({"SGLANG_HOST_IP": "10.0.0.2", "HOST_IP": "10.0.0.3"}) == "10.0.0.2"
    assert host_ip({"HOST_IP": "10.0.0.3"}) == "10.0.0.3"
    assert host_ip({}) is None


# ------------------------------------------------------------------------------ rooms

def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def rooms() -> tuple[Rooms, list[int]]:
    waiting: list[int] = []
    return Rooms(on_change=waiting.append), waiting


def test_a_prefill_first_waits_in_the_bootstrap_queue_for_its_decoder():
    async def go():
        r, waiting = rooms()
        prefill = asyncio.create_task(r.await_claim(5, timeout=5))
        await asyncio.sleep(0)
        queued = r.waiting_for_decoder()
        decode = asyncio.create_task(r.claim(5, Claim(64), timeout=5))
        room, claim = await prefill
        r.close(5, room, Outcome(tokens=64))
        return queued, claim, await decode, waiting
    queued, claim, outcome, waiting = run(go())
    assert queued == 1 and claim == Claim(64) and outcome == Outcome(tokens=64)
    assert waiting[0] == 1 and waiting[-1] == 0


def test_a_decoder_first_waits_for_its_prefill():
    async def go():
        r, _ = rooms()
        decode = asyncio.create_task(r.claim(5, Claim(64, fabric_ok=False), timeout=5))
        await asyncio.sleep(0)
        room, claim = await r.await_claim(5, timeout=5)
        r.close(5, room, Outcome(error="boom"))
        return claim, await decode, r.open
    claim, outcome, still_open = run(go())
    assert claim == Claim(64, fabric_ok=False) and outcome.error == "boom" and still_open == {}


def test_a_room_no_decoder_claims_closes_after_the_bootstrap_timeout_and_is_spent():
    async def go():
        r, _ = rooms()
        with pytest.raises(TimeoutError, match="KVPoll.Bootstrapping"):
            await r.await_claim(5, timeout=0.01)
        with pytest.raises(RoomRefused, match="one-shot"):
            await r.claim(5, Claim(1), timeout=5)
        return r.waiting_for_decoder()
    assert run(go()) == 0


def test_a_claim_no_prefill_comes_for_closes_after_the_waiting_timeout_and_is_spent():
    async def go():
        r, _ = rooms()
        outcome = await r.claim(5, Claim(1), timeout=0.01)
        with pytest.raises(RoomRefused, match="one-shot"):
            await r.await_claim(5, timeout=5)
        return outcome, r.open
    outcome, still_open = run(go())
    assert "KVPoll.WaitingForInput" in outcome.error and still_open == {}


def test_a_room_is_claimed_once_and_held_by_one_prefill():
    async def go():
        r, _ = rooms()
        first = asyncio.create_task(r.claim(5, Claim(1), timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(RoomRefused, match="already claimed"):
            await r.claim(5, Claim(1), timeout=5)
        prefill = asyncio.create_task(r.await_claim(6, timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(RoomRefused, match="another prefill"):
            await r.await_claim(6, timeout=5)
        first.cancel()
        prefill.cancel()
        await asyncio.gather(first, prefill, return_exceptions=True)
        return r.open
    assert run(go()) == {}


def test_a_cancelled_prefill_frees_its_room_and_tells_a_decoder_already_there():
    async def go():
        r, waiting = rooms()
        prefill = asyncio.create_task(r.await_claim(5, timeout=5))
        await asyncio.sleep(0)
        prefill.cancel()
        await asyncio.gather(prefill, return_exceptions=True)
        return r.open, waiting[-1]
    assert run(go()) == ({}, 0)


def test_a_decoder_that_leaves_a_room_being_prefilled_fails_its_transfer():
    async def go():
        r, _ = rooms()
        decode = asyncio.create_task(r.claim(5, Claim(1), timeout=5))
        await asyncio.sleep(0)
        room, _ = await r.await_claim(5, timeout=5)
        decode.cancel()
        await asyncio.gather(decode, return_exceptions=True)
        return room.abandoned, 5 in r.open
    assert run(go()) == (True, True)  # open until the prefill's send sees it and fails


# ------------------------------------------------------------------------------ one side

def side(mode: str, refuse: bool = False) -> SGLangDisagg:
    cfg = sglang("--disaggregation-mode", mode).disaggregation
    assert cfg is not None
    return SGLangDisagg(cfg, "127.0.0.1", SimMetrics("m").sglang_disagg(mode), refuse=lambda: refuse, env={})


def test_a_prefill_server_generates_one_token():
    p, d = side("prefill"), side("decode")
    body = {"prompt": "a", "max_tokens": 9, "max_completion_tokens": 9}
    assert p.request_body(body) == {"prompt": "a", "max_tokens": 1}
    assert d.request_body(body) is body


def test_what_stops_a_send():
    p = side("prefill")
    assert p.send_problem(Claim(64), 64) is None
    assert "made room for 65 prompt tokens, this prefill has 64" in p.send_problem(Claim(65), 64)
    assert "decoder's end of the fabric" in p.send_problem(Claim(64, fabric_ok=False), 64)
    assert "kv-transfer-fail" in side("prefill", refuse=True).send_problem(Claim(64), 64)


def test_a_decode_without_bootstrap_fields_is_a_500_and_a_bootstrap_failure():
    metrics = SimMetrics("m")
    cfg = sglang("--disaggregation-mode", "decode").disaggregation
    assert cfg is not None
    d = SGLangDisagg(cfg, "127.0.0.1", metrics.sglang_disagg("decode"), env={})
    with pytest.raises(DisaggError) as e:
        run(d.begin({"prompt": "a"}, [1], 1))
    assert e.value.code == 500 and "cannot prefill" in str(e.value)
    counted = [line for line in metrics.render().decode().splitlines()
               if line.startswith('sglang:num_bootstrap_failed_reqs_total{engine_type="decode"')]
    assert len(counted) == 1 and counted[0].endswith(" 1.0")


def test_the_fake_host_needs_no_peer_and_a_prefill_needs_a_room():
    d, p = side("decode"), side("prefill")
    fake = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
    assert run(d.begin(fake, [12], 1)).transferred == 12
    assert run(p.begin(fake, [12], 1)).transferred == 0
    with pytest.raises(DisaggError) as e:
        run(p.begin({"bootstrap_host": "10.0.0.1"}, [12], 1))
    assert e.value.code == 400 and "bootstrap_room is required" in str(e.value)


def test_the_metrics_carry_sglangs_names_and_labels():
    m = SimMetrics("m")
    m.sglang_disagg("prefill")
    text = m.render().decode()
    for name in ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_decode_transfer_queue_reqs",
                 "sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total",
                 "sglang:kv_transfer_latency_ms_count"):
        assert f'{name}{{engine_type="prefill",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"}}' in text, name
