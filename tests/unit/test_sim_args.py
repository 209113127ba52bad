"""The simulator parses exactly what the adapters emit, and refuses what the engines refuse."""

import pytest

from llmgw.catalog import Model, Profile
from llmgw.engines import LaunchContext, build_launch
from llmgw.sim.sim_args import ArgvError, human_readable_int, parse_argv, parse_vllm

SIM = {"vllm": ("llmgw-engine-sim",), "sglang": ("llmgw-engine-sim", "sglang"),
       "llamacpp": ("llmgw-engine-sim", "llama-server")}

HUB = Model("llama", "meta-llama/Llama-3.1-8B-Instruct", "llama-8b", max_model_len=8192)
GGUF = Model("phi", "/models/phi.gguf", "phi3", max_model_len=4096)

CONFIGS = [
    # (engine, model, tp, pp, nodes, rank, extra_args)
    ("vllm", HUB, 1, 1, 1, 0, ()),
    ("vllm", HUB, 4, 1, 1, 0, ("--gpu-memory-utilization", "0.85", "--enable-prefix-caching",
                              "--max-num-seqs", "64", "--dtype", "bfloat16", "--trust-remote-code")),
    ("vllm", HUB, 8, 2, 2, 0, ("--seed", "0", "--disable-log-requests")),
    ("vllm", HUB, 8, 2, 2, 1, ()),
    ("vllm", HUB, 4, 1, 4, 3, ()),
    ("sglang", HUB, 1, 1, 1, 0, ("--mem-fraction-static", "0.8")),
    ("sglang", HUB, 2, 2, 1, 0, ()),
    ("sglang", HUB, 16, 1, 2, 0, ()),
    ("sglang", HUB, 16, 1, 2, 1, ("--enable-metrics",)),
    ("llamacpp", GGUF, 1, 1, 1, 0, ("-np", "4")),
    ("llamacpp", GGUF, 2, 1, 1, 0, ()),
]


@pytest.mark.parametrize("engine,model,tp,pp,nodes,rank,extra", CONFIGS)
def test_adapter_argv_round_trips_through_the_simulator(engine, model, tp, pp, nodes, rank, extra):
    profile = Profile("p", engine, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                      nodes=nodes, extra_args=extra)
    ctx = LaunchContext(
        host="127.0.0.1", port=18000 + rank, model_path=model.source, rank=rank, nnodes=nodes,
        master_addr="10.0.0.1" if nodes > 1 else None, master_port=29600 if nodes > 1 else None,
        command=SIM[engine],
    )
    spec = build_launch(model, profile, ctx)
    assert spec.argv[0] == "llmgw-engine-sim"
    cfg = parse_argv(spec.argv[1:])
    assert cfg.dialect == engine
    assert cfg.model == model.source
    assert cfg.served_names == (model.served_name,)
    assert cfg.tensor_parallel_size == tp
    assert cfg.pipeline_parallel_size == pp
    assert cfg.nnodes == nodes
    assert cfg.node_rank == rank
    assert cfg.max_model_len == model.max_model_len
    assert cfg.headless is (not spec.serves_http)
    if spec.serves_http:
        assert (cfg.host, cfg.port) == ("127.0.0.1", spec.port)
    if nodes > 1:
        assert (cfg.master_addr, cfg.master_port) == ("10.0.0.1", 29600)


def test_vllm_served_model_name_takes_several_names_like_vllm():
    cfg = parse_vllm(["m", "--served-model-name", "a", "b", "--port", "9"])
    assert cfg.served_names == ("a", "b")
    assert parse_vllm(["m"]).served_names == ("m",)


def test_vllm_flexible_spellings():
    cfg = parse_vllm(["--model", "m", "--tensor_parallel_size=2", "-pp", "2", "--max-model-len", "32k"])
    assert (cfg.model, cfg.tensor_parallel_size, cfg.pipeline_parallel_size) == ("m", 2, 2)
    assert cfg.max_model_len == 32000
    assert parse_vllm(["m", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse_vllm(["m", "--api-key", "k1", "k2"]).api_keys == ("k1", "k2")


def test_human_readable_int():
    assert human_readable_int("4096") == 4096
    assert human_readable_int("1K") == 1024
    assert human_readable_int("25.6k") == 25600


def test_unknown_vllm_flag_exits_2_like_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        parse_argv(["serve", "m", "--port", "1", "--bogus-flag", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus-flag 3" in err
    assert err.startswith("usage: llmgw-engine-sim serve")


def test_bad_value_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_argv(["serve", "m", "--tensor-parallel-size", "two"])
    assert e.value.code == 2
    assert "argument --tensor-parallel-size/-tp: invalid int value: 'two'" in capsys.readouterr().err


def test_missing_model_exits_2():
    with pytest.raises(SystemExit) as e:
        parse_argv(["serve", "--port", "1"])
    assert e.value.code == 2


def test_unknown_dialect_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_argv(["trtllm-serve", "m"])
    assert e.value.code == 2
    assert "invalid choice: 'trtllm-serve'" in capsys.readouterr().err


def test_llama_server_unknown_flag_exits_1_like_llama_cpp(capsys):
    with pytest.raises(SystemExit) as e:
        parse_argv(["llama-server", "-m", "x.gguf", "--frobnicate"])
    assert e.value.code == 1
    assert "error: invalid argument: --frobnicate" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["m", "--nnodes", "2", "--node-rank", "2"], "node_rank (2) must be in [0, nnodes=2)"),
    (["m", "--nnodes", "2", "-tp", "2", "--distributed-executor-backend", "ray"], "nnodes > 1"),
    (["m", "--nnodes", "2", "-tp", "3"], "not divisible"),
])
def test_configurations_vllm_refuses_after_parsing(argv, needle):
    with pytest.raises(ArgvError) as e:
        parse_vllm(argv)
    assert needle in str(e.value)


def test_sglang_other_ranks_are_headless_and_need_a_rendezvous():
    cfg = parse_argv(["sglang", "--model-path", "m", "--nnodes", "2", "--node-rank", "1",
                      "--dist-init-addr", "10.0.0.1:5000"])
    assert cfg.headless and (cfg.master_addr, cfg.master_port) == ("10.0.0.1", 5000)
    with pytest.raises(ArgvError, match="dist-init-addr"):
        parse_argv(["sglang", "--model-path", "m", "--nnodes", "2"])


# ------------------------------------------------------------------ KV events and the KV cache

KV_ON = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///run/r1/kv.sock",
         "replay_endpoint": "ipc:///run/r1/kv-replay.sock", "topic": "kv@r1@m"}


def _kv(doc, *more):
    import json
    return parse_vllm(["m", "--enable-prefix-caching", "--kv-events-config", json.dumps(doc), *more])


def test_kv_events_config_is_read_as_vllm_reads_it():
    cfg = _kv(KV_ON, "--num-gpu-blocks-override", "16", "--block-size", "32")
    assert cfg.kv_events.endpoint == "ipc:///run/r1/kv.sock"
    assert cfg.kv_events.replay_endpoint == "ipc:///run/r1/kv-replay.sock"
    assert (cfg.kv_events.topic, cfg.kv_events.buffer_steps) == ("kv@r1@m", 10_000)
    assert (cfg.num_gpu_blocks, cfg.block_size) == (16, 32)
    # publisher defaults to zmq once events are on; off (or the null publisher) publishes nothing
    assert _kv({"enable_kv_cache_events": True, "endpoint": "ipc:///x"}).kv_events is not None
    assert _kv({**KV_ON, "enable_kv_cache_events": False}).kv_events is None
    assert _kv({**KV_ON, "publisher": "null"}).kv_events is None
    assert parse_vllm(["m"]).kv_events is None and parse_vllm(["m"]).block_size == 16


@pytest.mark.parametrize("endpoint,needle", [
    ("tcp://*:5557", "binds every network interface"),
    ("tcp://[::]:5557", "binds every network interface"),
    ("tcp://127.0.0.1:5557", "only ipc:// endpoints"),
    ("ipc://", "only ipc:// endpoints"),
])
@pytest.mark.parametrize("field", ["endpoint", "replay_endpoint"])
def test_kv_event_endpoints_other_than_ipc_are_refused(endpoint, needle, field):
    with pytest.raises(ArgvError, match=f"Invalid endpoint: kv_events_config.{field} .*{needle}"):
        _kv({**KV_ON, field: endpoint})


def test_the_default_endpoint_is_vllms_wildcard_and_is_refused():
    with pytest.raises(ArgvError, match=r"'tcp://\*:5557' binds every network interface"):
        _kv({"enable_kv_cache_events": True})


def test_ipc_with_data_parallel_ranks_is_refused_as_vllm_refuses_it():
    with pytest.raises(ArgvError, match="Invalid endpoint: must contain 'inproc' or 'tcp'"):
        _kv(KV_ON, "--data-parallel-size", "2")


@pytest.mark.parametrize("value,needle", [
    ("{not json", "not JSON"),
    ("[1]", "expected a JSON object"),
    ('{"enable_kv_cache_events": true, "endpint": "ipc:///x"}', "unexpected field 'endpint'"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events: wrong type str"),
    ('{"buffer_steps": true}', "buffer_steps: wrong type bool"),
    ('{"publisher": "kafka"}', "'kafka' is not one of"),
    ('{"hwm": 0}', "hwm: must be >= 1"),
])
def test_a_bad_kv_events_config_exits_2_naming_the_field(value, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_vllm(["m", "--kv-events-config", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-events-config" in err and needle in err


def test_a_kv_cache_of_fewer_than_two_blocks_is_refused():
    with pytest.raises(ArgvError, match="at least 2 blocks"):
        parse_vllm(["m", "--num-gpu-blocks-override", "1"])
