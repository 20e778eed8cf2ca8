"""The address a node's workers bind to (``daemon/address.py``): configured, or gloo's own, or,
where the host name resolves to loopback while etcd is over a network, the route to etcd."""

from __future__ import annotations

import pytest

from understudy.common.errors import ConfigError
from understudy.daemon.address import check_local, route_source, worker_address

ETCD = [("10.0.0.5", 2379), ("10.0.0.6", 2379)]


def test_the_configured_address_is_taken_as_it_is() -> None:
    assert worker_address(("10.20.12.17", "10.20.13.17"), ETCD,
                          resolve=lambda: "127.0.1.1") == ("10.20.12.17", "")


def test_a_host_name_that_resolves_to_a_network_address_is_left_to_gloo() -> None:
    assert worker_address((), ETCD, resolve=lambda: "10.20.12.17",
                          route=lambda host, port: "10.20.12.99") == (None, "")


def test_a_loopback_host_name_takes_the_route_to_etcd_and_says_why() -> None:
    tried: list[tuple[str, int]] = []

    def route(host: str, port: int) -> str | None:
        tried.append((host, port))
        return None if host == "10.0.0.5" else "10.20.12.17"  # no route to the first member

    address, why = worker_address((), ETCD, resolve=lambda: "127.0.1.1", route=route)
    assert address == "10.20.12.17" and tried == ETCD
    assert "resolves to 127.0.1.1" in why and "etcd at 10.0.0.6:2379" in why
    assert "set `addresses`" in why


def test_a_single_host_cluster_stays_on_loopback() -> None:
    # etcd on this host: the route to it is loopback too, and loopback is all there is to reach.
    assert route_source("127.0.0.1", 2379) == "127.0.0.1"
    assert worker_address((), [("127.0.0.1", 2379)], resolve=lambda: "127.0.1.1") == (None, "")
    assert worker_address((), ETCD, resolve=lambda: None,
                          route=lambda host, port: None) == (None, "")


def test_an_address_that_is_not_this_hosts_is_refused_with_the_reason() -> None:
    check_local("127.0.0.1")
    with pytest.raises(ConfigError, match=r"198\.51\.100\.77' is not an address of this host"):
        check_local("198.51.100.77")  # TEST-NET-2: nobody's
    with pytest.raises(ConfigError, match="does not resolve"):
        check_local("no-such-host.invalid")
