"""The vLLM plugin's settings (issue 42) without vLLM: where the exchange mode and the link latency come
from (the environment, then the config's `dtp` entry, then the platform's default) and what is refused."""

from __future__ import annotations

import pytest

from models.serving.vllm.options import EXCHANGE_ENV, LATENCY_ENV, PluginSettings, resolve_settings


def test_the_platform_default_is_eager_on_cpu_and_overlap_on_cuda() -> None:
    assert resolve_settings(None, {}, "cpu") == PluginSettings("eager", 0.0, "the default on cpu")
    assert resolve_settings({}, {}, "cuda").exchange == "overlap"
    assert resolve_settings({}, {}, "xpu").exchange == "eager"


def test_the_environment_wins_over_the_config_entry_which_wins_over_the_default() -> None:
    entry = {"exchange": "overlap", "link_latency_us": 250}
    from_config = resolve_settings(entry, {}, "cpu")
    assert (from_config.exchange, from_config.link_latency_us) == ("overlap", 250.0)
    assert from_config.source == "from config 'dtp'.exchange"
    env = {EXCHANGE_ENV: "eager", LATENCY_ENV: "2000"}
    from_env = resolve_settings(entry, env, "cpu")
    assert (from_env.exchange, from_env.link_latency_us, from_env.source) == ("eager", 2000.0, f"from {EXCHANGE_ENV}")
    assert "exchange eager (from DTP_LAYOUT_VLLM_EXCHANGE;" in from_env.describe()
    assert "link latency 2000 µs" in from_env.describe()
    assert resolve_settings(entry, {EXCHANGE_ENV: ""}, "cpu").exchange == "overlap"  # empty: not set


@pytest.mark.parametrize(("entry", "env", "message"), [
    ({"exchange": "lazy"}, {}, "config 'dtp'.exchange: exchange mode must be one of eager, overlap, got 'lazy'"),
    ({}, {EXCHANGE_ENV: "sync"}, f"{EXCHANGE_ENV}: exchange mode must be one of eager, overlap"),
    ({"link_latency_us": -5}, {}, "config 'dtp'.link_latency_us: link latency must be a number of µs"),
    ({}, {LATENCY_ENV: "nan"}, f"{LATENCY_ENV}: link latency must be a number of µs in [0, 1e+06]"),
    ({}, {LATENCY_ENV: "1e9"}, f"{LATENCY_ENV}: link latency must be"),
    ({"link_latency_us": "fast"}, {}, "got 'fast'"),
])
def test_bad_settings_are_refused_naming_where_they_came_from(entry: dict[str, object], env: dict[str, str],
                                                              message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        resolve_settings(entry, env, "cpu")
