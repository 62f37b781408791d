"""`dns+` pool entries as the gateway reads them: which URLs an entry's addresses become, and which
entries `llmserve gateway` accepts (the entries resolved for real are in test_replica_lifecycle.py)."""

from __future__ import annotations

import pytest

from llmserve.gateway.discovery import entry_host, replica_url
from llmserve.gateway.serve import parse_pools


def test_each_address_of_an_entry_is_a_replica_url() -> None:
    entry = "dns+http://llmserve-replica-headless.llmserve.svc:8000"
    assert entry_host(entry) == "llmserve-replica-headless.llmserve.svc"
    assert replica_url(entry, "10.0.3.7") == "http://10.0.3.7:8000"
    assert replica_url(entry, "fd00::7") == "http://[fd00::7]:8000"
    assert replica_url("dns+https://replicas/prefix/", "10.0.0.1") == "https://10.0.0.1/prefix"


def test_parse_pools_takes_dns_entries_and_refuses_what_cannot_resolve() -> None:
    pools = parse_pools(["m=dns+http://replicas:8000,http://10.0.0.9:8000"], None)
    assert pools == {"m": ["dns+http://replicas:8000", "http://10.0.0.9:8000"]}
    with pytest.raises(ValueError, match="not an http"):
        parse_pools(["m=dns+ftp://replicas:8000"], None)
    with pytest.raises(ValueError, match="needs a host name"):
        parse_pools(["m=dns+http://:8000"], None)


def test_parse_pools_takes_the_pools_from_flags_when_the_config_has_none(tmp_path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("prices: {m: {input: 1.0, output: 2.0}}\n")
    assert parse_pools(["m=http://10.0.0.9:8000"], str(config)) == {"m": ["http://10.0.0.9:8000"]}
