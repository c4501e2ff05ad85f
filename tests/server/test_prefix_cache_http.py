"""Prefix caching over HTTP: cached_tokens in usage, cache_salt, the counters, the reset route."""

from __future__ import annotations

from tests.server.live import metric_value, wait_until_idle

# Long enough for several 16-token blocks once tokenized.
SYSTEM = "You are a careful assistant who answers in short Python snippets. " * 2


def _cached(client, server, prompt: str, **extra) -> int:
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=2,
                                    temperature=0, extra_body=extra or None)
    return out.usage.prompt_tokens_details.cached_tokens


def test_repeated_prefix_is_reported_cached_and_salts_keep_tenants_apart(client, server):
    with server.http() as http:
        assert http.post("/reset_prefix_cache").status_code == 200
    before = http_metrics(server)
    assert _cached(client, server, SYSTEM + "Q1") == 0
    assert _cached(client, server, SYSTEM + "Q2") > 0
    assert _cached(client, server, SYSTEM + "Q3", cache_salt="tenant-b") == 0
    assert _cached(client, server, SYSTEM + "Q4", cache_salt="tenant-b") > 0
    chat = client.chat.completions.create(
        model=server.model, max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0
    wait_until_idle(server)
    after = http_metrics(server)
    assert after["carpool:prefix_cache_hits_total"] > before["carpool:prefix_cache_hits_total"]
    assert (after["carpool:prefix_cache_queries_total"]
            > after["carpool:prefix_cache_hits_total"] - before["carpool:prefix_cache_hits_total"])
    assert after["carpool:prompt_tokens_cached_total"] > before["carpool:prompt_tokens_cached_total"]
    with server.http() as http:
        assert http.post("/reset_prefix_cache").status_code == 200
        assert http.get("/stats", params={"integrity": "true"}).json()["integrity"] == "ok"
    assert _cached(client, server, SYSTEM + "Q5") == 0


def http_metrics(server) -> dict:
    with server.http() as http:
        text = http.get("/metrics").text
    return {name: metric_value(text, name) for name in (
        "carpool:prefix_cache_queries_total", "carpool:prefix_cache_hits_total",
        "carpool:prompt_tokens_cached_total")}
