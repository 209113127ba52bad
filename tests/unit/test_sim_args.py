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
