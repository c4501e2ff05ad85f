"""The OpenAPI document matches what the server answers (issue 64 item 13): schemathesis
generates requests from /openapi.json and checks each answer's status code, content type
and body against it. Errors are 400s in OpenAI's body (not FastAPI's 422), the probes and
/reset_prefix_cache answer with an empty body, /metrics in Prometheus' text."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

from tests.reliability.live import AUTH

pytestmark = pytest.mark.slow  # a live server (still run in CI)

CHECKS = ("status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "not_a_server_error")
# The routes issue 64 touched, and the generation routes whose errors were documented 422.
ROUTES = (r"^/(health|ping|load|version|metrics|reset_prefix_cache|tokenize|detokenize"
          r"|v1/completions|v1/chat/completions)$")


def test_the_document_says_400_and_empty_probes(edge_server):
    with httpx.Client(base_url=edge_server.base_url, headers=AUTH, timeout=30) as http:
        doc = http.get("/openapi.json").json()
    text = json.dumps(doc)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        assert "400" in doc["paths"][path]["post"]["responses"]
    for path, method in (("/health", "get"), ("/ping", "get"), ("/ping", "post"),
                         ("/reset_prefix_cache", "post")):
        assert "content" not in doc["paths"][path][method]["responses"]["200"], path
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis not installed")
def test_schemathesis_conformance_checks_pass(edge_server, tmp_path):
    done = subprocess.run(
        ["schemathesis", "run", f"{edge_server.base_url}/openapi.json",
         "-H", f"Authorization: {AUTH['Authorization']}", "--checks", ",".join(CHECKS),
         "--include-path-regex", ROUTES, "--max-examples", "15",
         "--generation-deterministic", "--request-timeout", "60"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
