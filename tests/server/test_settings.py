"""Server flags become validated ServerSettings; a bad value names its field."""

from __future__ import annotations

import argparse

import pytest

from carpool.server.app import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_SHUTDOWN_TIMEOUT_S,
                                ServerSettings)
from carpool.server.cli import add_arguments, server_settings_from_args


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults():
    settings = server_settings_from_args(_parse())
    assert settings.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES
    assert settings.max_num_waiting_requests is None  # 4 x max_num_seqs once loaded
    assert settings.shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT_S
    assert settings.log_prompts is False
    assert settings.log_requests is False and settings.log_stats is True  # vLLM's defaults


def test_flags_reach_the_settings():
    settings = server_settings_from_args(_parse(
        "--max-request-body-bytes", "2MiB", "--max-num-waiting-requests", "7",
        "--shutdown-timeout", "2.5", "--log-prompts", "--api-key", "k", "--disable-log-stats"))
    assert settings == ServerSettings(api_key="k", max_request_body_bytes=2 * 2**20,
                                      max_num_waiting_requests=7, shutdown_timeout=2.5,
                                      log_prompts=True, log_requests=True, log_stats=False)
    assert server_settings_from_args(_parse("--enable-log-requests")).log_requests is True


@pytest.mark.parametrize("field,value", [
    ("max_request_body_bytes", 0), ("max_num_waiting_requests", 0),
    ("shutdown_timeout", -1.0), ("shutdown_timeout", float("inf")),
    ("shutdown_timeout", float("nan")), ("api_key", "")])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ServerSettings(**{field: value})


def test_prefix_caching_flag_is_on_by_default_and_can_be_turned_off():
    from carpool.config import EngineConfig

    def enabled(*argv: str) -> bool:
        return EngineConfig.from_cli_args(_parse(*argv)).scheduler.enable_prefix_caching

    assert enabled() is True
    assert enabled("--no-enable-prefix-caching") is False
    assert enabled("--enable-prefix-caching") is True
