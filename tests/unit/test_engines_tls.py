"""Engine TLS: the adapters own the certificate flags and emit them only where the engine serves TLS.

vLLM (``--ssl-keyfile/--ssl-certfile``) and llama-server (``--ssl-key-file/--ssl-cert-file``,
served when built with OpenSSL) get the node's engine certificate on rank 0; SGLang's pinned
release has no such flags and stays plain HTTP.  A profile cannot set any of them: the
router verifies engines against the fleet CA and presents no client certificate.  The
simulator parses the same argv as the engine would and ends up with the same files.
"""

from __future__ import annotations

import pytest

from llmgw.catalog import Model, Profile
from llmgw.config import ConfigInvalid
from llmgw.engines import LaunchContext, ProfileError, build_launch, validate_profile
from llmgw.settings import parse_agent_settings
from llmgw.sim.sim_args import parse_argv

HUB = Model(name="tiny", source="org/tiny", served_name="tiny")
GGUF = Model(name="g", source="/models/g.gguf", served_name="g")
CERT, KEY = "/etc/llmgw/engine.crt", "/etc/llmgw/engine.key"
SKIP = {"vllm": 2, "llama-server": 1, "python": 3}  # the engine's own command, replaced by the dialect word


def launch(engine: str, model: Model, tmp_path, profile: Profile | None = None, **kw):
    base = dict(host="10.0.0.5", port=8001, model_path=model.source, gpu_indices=(0,),
                secret_dir=str(tmp_path), tls_cert=CERT, tls_key=KEY)
    base.update(kw)
    return build_launch(model, profile or Profile("p", engine), LaunchContext(**base))


def simulated(spec, dialect: str):
    return parse_argv([dialect, *spec.argv[SKIP[spec.argv[0]]:]])


@pytest.mark.parametrize("engine, model, dialect, flags", [
    ("vllm", HUB, "serve", ("--ssl-keyfile", KEY, "--ssl-certfile", CERT)),
    ("llamacpp", GGUF, "llama-server", ("--ssl-key-file", KEY, "--ssl-cert-file", CERT)),
])
def test_rank0_serves_tls_with_the_engine_certificate(engine, model, dialect, flags, tmp_path):
    spec = launch(engine, model, tmp_path)
    argv = list(spec.argv)
    i = argv.index(flags[0])
    assert tuple(argv[i:i + 4]) == flags
    assert spec.tls
    cfg = simulated(spec, dialect)
    assert (cfg.ssl_keyfile, cfg.ssl_certfile) == (KEY, CERT)


@pytest.mark.parametrize("engine, model", [("vllm", HUB), ("llamacpp", GGUF), ("sglang", HUB)])
def test_no_certificate_no_tls(engine, model, tmp_path):
    spec = launch(engine, model, tmp_path, tls_cert=None, tls_key=None)
    assert not spec.tls
    assert not any(a.startswith("--ssl") for a in spec.argv)


def test_sglang_pinned_release_has_no_tls_so_it_stays_http(tmp_path):
    spec = launch("sglang", HUB, tmp_path)
    assert not spec.tls
    assert not any(a.startswith("--ssl") for a in spec.argv)
    assert simulated(spec, "sglang").ssl_keyfile is None


def test_worker_ranks_serve_no_http_and_get_no_certificate(tmp_path):
    spec = launch("vllm", HUB, tmp_path, profile=Profile("mn", "vllm", tensor_parallel_size=2, nodes=2),
                  rank=1, nnodes=2, master_addr="10.0.0.1", master_port=29501)
    assert not spec.tls and not spec.serves_http
    assert "--ssl-keyfile" not in spec.argv


@pytest.mark.parametrize("engine, args, flag", [
    ("vllm", ["--ssl-keyfile", "/tmp/k"], "--ssl-keyfile"),
    ("vllm", ["--ssl_certfile=/tmp/c"], "--ssl-certfile"),
    ("vllm", ["--ssl-ca-certs", "/tmp/ca"], "--ssl-ca-certs"),
    ("vllm", ["--ssl-cert-reqs", "2"], "--ssl-cert-reqs"),
    ("llamacpp", ["--ssl-key-file", "/tmp/k"], "--ssl-key-file"),
    ("llamacpp", ["--ssl-cert-file", "/tmp/c"], "--ssl-cert-file"),
])
def test_profile_cannot_set_the_tls_flags(engine, args, flag):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", engine, extra_args=tuple(args)))
    assert f"extra_args sets {flag}" in str(e.value)
    assert "engine_tls" in str(e.value)
    assert e.value.paths == ("extra_args/0",)


@pytest.mark.parametrize("var", ["LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE"])
def test_llamacpp_profile_cannot_set_the_tls_variables(var):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", "llamacpp", env=((var, "/tmp/x"),)))
    assert f"env sets {var}" in str(e.value)


AGENT = {"node_id": "n1", "control_plane": {"url": "wss://cp:8443/v1/agent/stream"}, "state_dir": "/tmp/s",
         "tls": {"ca": "/ca.crt", "cert": "/n.crt", "key": "/n.key"}}


def test_engines_bind_the_advertise_address_by_default():
    s = parse_agent_settings({**AGENT, "advertise_address": "10.1.2.3"})
    assert s.engine_bind_host == "10.1.2.3"
    assert parse_agent_settings({**AGENT, "advertise_address": "10.1.2.3",
                                 "engine_bind_host": "0.0.0.0"}).engine_bind_host == "0.0.0.0"


def test_engine_tls_needs_the_fleet_ca():
    doc = {k: v for k, v in AGENT.items() if k != "tls"}
    doc.update(insecure_no_tls=True, control_plane={"url": "ws://cp:8443/v1/agent/stream"},
               engine_tls={"cert": CERT, "key": KEY})
    with pytest.raises(ConfigInvalid) as e:
        parse_agent_settings(doc)
    assert [err.pointer for err in e.value.errors] == ["/engine_tls"]
    s = parse_agent_settings({**AGENT, "engine_tls": {"cert": CERT, "key": KEY, "engines": ["vllm"]}})
    assert (s.engine_tls.cert, s.engine_tls.engines) == (CERT, ("vllm",))


def test_vllm_polls_its_certificate_files_so_every_renewal_by_rename_is_seen(tmp_path):
    """vLLM's --enable-ssl-refresh watches the two paths with watchfiles, whose inotify watch stays on
    the inode a rename replaces: only the first renewal would be served. Polling follows the paths."""
    spec = launch("vllm", HUB, tmp_path)
    assert spec.env["WATCHFILES_FORCE_POLLING"] == "1" and "--enable-ssl-refresh" in spec.argv
    plain = launch("vllm", HUB, tmp_path, tls_cert=None, tls_key=None)
    assert "WATCHFILES_FORCE_POLLING" not in plain.env


@pytest.mark.parametrize("value", ["0", "false"])
def test_vllm_profile_cannot_turn_the_certificate_polling_off(value):
    with pytest.raises(ProfileError) as e:
        validate_profile(Profile("p", "vllm", env=(("WATCHFILES_FORCE_POLLING", value),)))
    assert "env sets WATCHFILES_FORCE_POLLING" in str(e.value) and "engine_tls" in str(e.value)
    assert e.value.paths == ("env/WATCHFILES_FORCE_POLLING",)
