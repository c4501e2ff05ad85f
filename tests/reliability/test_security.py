"""Security defaults: loopback bind, the API key on every route but /health (compared in
constant time), no pickle anywhere, no remote code, and prompts kept out of the logs."""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import carpool
from carpool.bench.local_server import free_port
from carpool.engine.async_engine import AsyncEngine
from carpool.server import app as app_module
from carpool.server.app import build_app, is_protected
from carpool.server.cli import add_arguments
from tests.reliability.live import API_KEY, MODEL, assert_openai_error

pytestmark = pytest.mark.slow  # a live server (still run in CI)

PACKAGE = Path(carpool.__file__).parent
UNSAFE_LOADING = [
    re.compile(r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle|joblib|shelve)\b",
               re.M),
    re.compile(r"\b(pickle|dill|cloudpickle|joblib|marshal)\.(load|loads|Unpickler)\b"),
    re.compile(r"\btorch\.load\s*\("),
    re.compile(r"allow_pickle\s*=\s*True"),
    re.compile(r"weights_only\s*=\s*False"),
    re.compile(r"trust_remote_code\s*=\s*True"),
    re.compile(r"(?<![.\w])(eval|exec)\s*\("),
]


def test_serve_binds_loopback_unless_told():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).host == "127.0.0.1"


def test_live_server_listens_on_loopback_only(edge_server):
    port = int(edge_server.base_url.rsplit(":", 1)[1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                listening.append(address)
    assert listening == ["0100007F"], listening  # 127.0.0.1, and nothing else


def _all_routes() -> list[tuple[str, str]]:
    app = build_app(AsyncEngine(lambda: None), app_module.ServerSettings(api_key="x"))
    routes = []
    flat = []
    for route in app.routes:  # included routers are wrapped: unwrap them
        router = getattr(route, "original_router", None)
        flat.extend(router.routes if router is not None else [route])
    for route in flat:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                routes.append((method, route.path))
    return routes


def test_the_api_key_guards_v1_and_the_state_routes_and_no_other(edge_server):
    """vLLM's rule, /v1/*, plus the routes that cost work or change or reveal the server's
    state (issue 64 item 4: three anonymous 4 MB /tokenize calls delayed a keyed
    completion); a Prometheus scrape or a probe sends no key."""
    routes = _all_routes()
    paths = {path for _, path in routes}
    state_routes = {"/tokenize", "/detokenize", "/stats", "/reset_prefix_cache",
                    "/openapi.json", "/docs", "/redoc"}
    open_routes = {"/metrics", "/health", "/ping", "/load", "/version"}
    assert state_routes | open_routes | {"/v1/completions"} <= paths
    assert all(is_protected(path) for path in state_routes)
    assert not any(is_protected(path) for path in open_routes)
    with httpx.Client(base_url=edge_server.base_url, timeout=30) as anonymous:
        for method, path in routes:
            response = anonymous.request(method, path.replace("{model_id:path}", MODEL),
                                         json={"prompt": "x", "model": MODEL})
            if not is_protected(path):
                assert response.status_code != 401, (method, path)
                continue
            error = assert_openai_error(response, 401)
            assert error["code"] == "invalid_api_key", (method, path)
            for wrong in (API_KEY[:-1], API_KEY + "x", API_KEY.upper(), "x"):
                response = anonymous.request(method, path.replace("{model_id:path}", MODEL),
                                             headers={"Authorization": f"Bearer {wrong}"})
                assert response.status_code == 401, (method, path, wrong)


def test_api_key_is_compared_in_constant_time():
    """Digests of equal length through hmac.compare_digest: no early exit on the first
    differing byte or on a different length."""
    source = inspect.getsource(app_module.APIKeyMiddleware)
    assert "hmac.compare_digest(_digest(given), self._expected)" in source
    assert "hashlib.sha256" in inspect.getsource(app_module._digest)
    assert not re.search(r"given\s*==|==\s*self\._expected", source)


def test_nothing_in_carpool_unpickles_or_runs_loaded_code():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for pattern in UNSAFE_LOADING:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {match.group(0)}")
    assert not offenders, offenders


def test_the_grep_catches_what_it_looks_for():
    samples = ["import pickle", "state = torch.load(f)", "np.load(f, allow_pickle=True)",
               "torch.load(f, weights_only=False)", "AutoModel.from_pretrained(p, "
               "trust_remote_code=True)", "from joblib import load", "eval(text)"]
    assert not any(p.search("model.eval()") for p in UNSAFE_LOADING)
    for sample in samples:
        assert any(p.search(sample) for p in UNSAFE_LOADING), sample


def test_checkpoint_without_safetensors_is_refused(llama_checkpoint, tmp_path):
    folder = tmp_path / "bin-only"
    shutil.copytree(llama_checkpoint, folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    from carpool import LLM
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        LLM(str(folder))


def test_trust_remote_code_is_refused_with_a_reason(llama_checkpoint):
    process = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", str(llama_checkpoint), "--port",
         str(free_port()), "--trust-remote-code"], capture_output=True, text=True, timeout=120)
    assert process.returncode == 1
    assert "--trust-remote-code is not supported" in process.stderr
    assert "safetensors" in process.stderr


def test_prompts_are_not_logged_without_log_prompts(edge_server):
    marker = "secret-prompt-7f3a9c"
    with edge_server.http() as http:
        for path, body in (("/v1/completions", {"prompt": marker, "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [
                               {"role": "user", "content": marker}], "max_tokens": 2}),
                           ("/v1/completions", {"prompt": marker, "max_tokens": 10**6}),
                           ("/tokenize", {"prompt": marker})):
            http.post(path, json={"model": MODEL, **body})
    log = edge_server.log()
    assert "request cmpl-" in log  # requests are logged ...
    assert marker not in log  # ... but never their prompts
