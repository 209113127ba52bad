"""How big are the weights: declared, or measured from the files, never guessed."""

import ast
import http.server
import inspect
import threading

import pytest

from llmgw import catalog
from llmgw.catalog import Model, weights_bytes
from llmgw.controlplane import reconciler
from llmgw.weightprobe import local_weights_bytes, measure_sources, remote_weights_bytes
from tests.support.ports import closed_port


def sized(path, n):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(n)  # sparse: the size is what counts, not the blocks
    return path


def test_a_file_counts_whole(tmp_path):
    assert local_weights_bytes(sized(tmp_path / "m.gguf", 4096)) == 4096


def test_a_directory_counts_only_the_copy_the_engine_loads(tmp_path):
    sized(tmp_path / "model-00001-of-00002.safetensors", 3000)
    sized(tmp_path / "sub" / "model-00002-of-00002.safetensors", 2000)
    sized(tmp_path / "pytorch_model.bin", 9000)  # the same tensors again, not loaded
    sized(tmp_path / "tokenizer.json", 700)
    assert local_weights_bytes(tmp_path) == 5000


def test_bin_only_directory(tmp_path):
    sized(tmp_path / "pytorch_model.bin", 9000)
    assert local_weights_bytes(tmp_path) == 9000


def test_unknown_is_none_never_zero(tmp_path):
    assert local_weights_bytes(tmp_path / "absent") is None
    sized(tmp_path / "config.json", 10)
    assert local_weights_bytes(tmp_path) is None


def test_declared_size_wins_over_a_measured_one():
    m = Model("m", "/w/m.gguf", "m", size_bytes=100)
    assert weights_bytes(m, {"/w/m.gguf": 999}) == 100
    bare = Model("m", "/w/m.gguf", "m")
    assert weights_bytes(bare, {"/w/m.gguf": 999}) == 999
    assert weights_bytes(bare, {}) is None and weights_bytes(bare) is None


def imported(module) -> set[str]:
    """Every module ``module`` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_catalog_and_the_reconciler_read_no_weights_themselves():
    """Sizing is read in llmgw.weightprobe: the data model and the pure reconciler do no I/O for it."""
    io = {"httpx", "huggingface_hub", "huggingface_hub.hf_api", "llmgw.weightprobe", "llmgw.controlplane.sizing"}
    for module in (catalog, reconciler):
        assert not imported(module) & io, f"{module.__name__} imports {sorted(imported(module) & io)}"


def test_measure_sources_reads_local_paths_and_never_hub_ids(tmp_path):
    f = sized(tmp_path / "m.gguf", 1234)
    models = [
        Model("local", str(f), "local"),
        Model("declared", str(f), "declared", size_bytes=5),
        Model("hub", "Qwen/Qwen2.5-0.5B-Instruct", "hub"),
        Model("missing", str(tmp_path / "nope.gguf"), "missing"),
        Model("url", "https://127.0.0.1:1/m.gguf", "url"),
    ]
    assert measure_sources(models) == {str(f): 1234}


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802
        if self.path == "/w.gguf":
            self.send_response(200)
            self.send_header("Content-Length", "777777")
        elif self.path == "/moved.gguf":
            self.send_response(302)
            self.send_header("Location", "/w.gguf")
            self.send_header("Content-Length", "0")
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_remote_size_from_content_length_following_redirects(server):
    assert remote_weights_bytes(f"{server}/w.gguf") == 777777
    assert remote_weights_bytes(f"{server}/moved.gguf") == 777777
    assert remote_weights_bytes(f"{server}/missing.gguf") is None
    models = [Model("u", f"{server}/w.gguf", "u")]
    assert measure_sources(models) == {}  # remote only when asked
    assert measure_sources(models, remote=True) == {f"{server}/w.gguf": 777777}


def test_unreachable_remote_is_none(server):
    port = int(server.rsplit(":", 1)[1])
    free = closed_port()
    assert free != port
    assert remote_weights_bytes(f"http://127.0.0.1:{free}/w.gguf", timeout=5) is None
