"""etcd over TLS with client certificates, and etcd users and roles, against a real etcd.

etcd runs with ``--client-cert-auth`` and a server certificate for 127.0.0.1 from a throwaway
CA; for the auth tests, users and roles are created and ``auth enable`` is run with etcdctl, as
an operator would. The daemons are real ``understudyd`` processes and the CLI is the real CLI.

What etcd 3.4 does, as these tests pin down:
- a client without a certificate, or with one from another CA, is refused in the TLS handshake;
- with auth enabled, a request carrying a token (from user + password) runs as that user; a
  request without a token runs as the user named by the client certificate's CN (no password
  is checked), and is refused if no such user exists. A token always wins over the CN;
- a wrong password fails at Authenticate ("authentication failed, invalid user ID or
  password"); a user whose roles do not cover a key gets "permission denied";
- lease grants and keep-alives need no key permission; every key the daemon reads, writes or
  watches is under the cluster prefix, so a role with ``readwrite /understudy/ --prefix`` is
  enough (the revision probe reads an empty range inside the prefix for that reason);
- an expired simple token is "invalid auth token"; the store logs in again.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.certs import CertAuthority, CertPair, have_openssl
from tests.integration.exposition import scrape, value
from tests.integration.scenarios import wait_log
from understudy.common import config
from understudy.common import env as env_vars
from understudy.common import store as store_mod
from understudy.common.config import EtcdConfig
from understudy.common.errors import StoreError
from understudy.common.keys import Keys
from understudy.common.store import EtcdStore
from understudy.testing.embedded_etcd import EmbeddedEtcd, TlsFiles
from understudy.testing.localcluster import LocalCluster

pytestmark = pytest.mark.slow

PREFIX = "/understudy"
ROOT_PASSWORD = "root-secret"
PASSWORD = "understudy-secret"
OUTSIDER_PASSWORD = "outsider-secret"


@dataclass(frozen=True)
class Pki:
    ca: CertAuthority
    server: CertPair
    #: CN "node-client" is not an etcd user: with auth on, only a password login gives rights.
    client: CertPair
    #: CN "understudy" is an etcd user: without a password etcd takes the user from the CN.
    named_client: CertPair
    #: Signed by a CA etcd does not trust.
    foreign: CertPair
    foreign_ca: CertAuthority


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if not have_openssl():
        pytest.fail("the openssl command is not installed: it makes the test certificates")
    d = tmp_path_factory.mktemp("pki")
    ca = CertAuthority.create(d / "ca", "understudy-test-ca")
    other = CertAuthority.create(d / "other", "other-ca")
    return Pki(ca=ca, server=ca.server(), client=ca.client("node-client"),
               named_client=ca.client("understudy"), foreign=other.client("node-client"),
               foreign_ca=other)


def _start(pki: Pki, data_dir: Path, extra: list[str] | None = None) -> EmbeddedEtcd:
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: the test command installs it (scripts/test)")
    return EmbeddedEtcd(data_dir=data_dir, tls=TlsFiles(pki.ca.cert, pki.server.cert,
                                                        pki.server.key),
                        extra_args=extra or []).start()


def etcdctl(server: EmbeddedEtcd, pki: Pki, *args: str, user: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("etcdctl")
    if binary is None:
        pytest.fail("etcdctl is not installed: scripts/setup installs etcd-client")
    argv = [binary, f"--endpoints=https://{server.endpoint}", f"--cacert={pki.ca.cert}",
            f"--cert={pki.client.cert}", f"--key={pki.client.key}", "--dial-timeout=3s",
            "--command-timeout=5s", *(["--user", user] if user else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=15,
                          env={**os.environ, "ETCDCTL_API": "3"})


def enable_auth(server: EmbeddedEtcd, pki: Pki) -> None:
    """root (required by ``auth enable``), ``understudy`` with readwrite on the cluster prefix
    only, and ``outsider`` with readwrite on another prefix; then auth is switched on."""
    steps = [
        ("user", "add", f"root:{ROOT_PASSWORD}"),
        ("user", "grant-role", "root", "root"),
        ("role", "add", "understudy"),
        ("role", "grant-permission", "understudy", "readwrite", f"{PREFIX}/", "--prefix=true"),
        ("user", "add", f"understudy:{PASSWORD}"),
        ("user", "grant-role", "understudy", "understudy"),
        ("role", "add", "outsider"),
        ("role", "grant-permission", "outsider", "readwrite", "/other/", "--prefix=true"),
        ("user", "add", f"outsider:{OUTSIDER_PASSWORD}"),
        ("user", "grant-role", "outsider", "outsider"),
        ("auth", "enable"),
    ]
    for step in steps:
        res = etcdctl(server, pki, *step)
        assert res.returncode == 0, f"etcdctl {' '.join(step)}: {res.stderr.strip()}"


@pytest.fixture(scope="module")
def tls_etcd(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    server = _start(pki, tmp_path_factory.mktemp("tls-etcd"))
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def auth_etcd(pki: Pki, tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    server = _start(pki, tmp_path / "etcd")
    try:
        enable_auth(server, pki)
        yield server
    finally:
        server.cleanup()


def _cfg(server: EmbeddedEtcd, ca: Path, cert: CertPair | None = None,
         user: str | None = None, password: str | None = None) -> EtcdConfig:
    return EtcdConfig(endpoints=config.parse_endpoints(server.endpoint), ca=ca,
                      cert=cert.cert if cert else None, key=cert.key if cert else None,
                      user=user, password=password, timeout=1.0)


def _refusal(cfg: EtcdConfig) -> tuple[str, float]:
    """The StoreError message of a first put with ``cfg`` and how long it took to fail."""

    async def run() -> tuple[str, float]:
        store = EtcdStore(cfg)
        t0 = time.monotonic()
        try:
            await store.put(f"{PREFIX}/t/refused", b"x")
        except StoreError as exc:
            return str(exc), time.monotonic() - t0
        finally:
            await store.close()
        raise AssertionError("the put was not refused")

    return asyncio.run(run())


def _one_sentence(text: str) -> None:
    assert text and "\n" not in text.strip() and "Traceback" not in text, text


# -- TLS: the store -------------------------------------------------------------------------


def test_store_with_client_certificate_reads_writes_and_leases(tls_etcd: EmbeddedEtcd,
                                                               pki: Pki) -> None:
    async def run() -> None:
        store = EtcdStore(_cfg(tls_etcd, pki.ca.cert, pki.client))
        try:
            lease = await store.grant(2)
            await store.put(f"{PREFIX}/t/alive", b"1", lease=lease)
            assert await store.cas(f"{PREFIX}/t/plain", b"a", 0)
            kv = await store.get(f"{PREFIX}/t/alive")
            assert kv is not None and kv.value == b"1" and kv.lease == lease
            assert await store.keepalive(lease) >= 1
            kvs, _ = await store.get_prefix(f"{PREFIX}/t/")
            assert {k.key for k in kvs} == {f"{PREFIX}/t/alive", f"{PREFIX}/t/plain"}
            await store.revoke(lease)
            assert await store.get(f"{PREFIX}/t/alive") is None
        finally:
            await store.close()

    asyncio.run(run())


@pytest.mark.parametrize("case", ["no client certificate", "client certificate of another CA",
                                  "server not signed by the trusted CA"])
def test_store_without_a_trusted_certificate_fails_within_the_timeout(
        tls_etcd: EmbeddedEtcd, pki: Pki, case: str) -> None:
    cfg = {
        "no client certificate": _cfg(tls_etcd, pki.ca.cert),
        "client certificate of another CA": _cfg(tls_etcd, pki.ca.cert, pki.foreign),
        "server not signed by the trusted CA": _cfg(tls_etcd, pki.foreign_ca.cert, pki.client),
    }[case]
    message, took = _refusal(cfg)
    _one_sentence(message)
    assert message.startswith("etcd put failed"), message
    assert took < cfg.timeout + 0.5, f"refusal took {took:.2f}s"


def test_rotated_certificates_are_loaded_again_without_a_restart(
        pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review M6: the store read its CA, certificate and key once, so rotating them took a
    daemon restart (which drains the node). Here etcd moves to a new CA; the store, given the
    same paths, connects again once their new contents are in place, and keeps the old ones
    while a half-written set (a key that is not the certificate's) does not load."""
    monkeypatch.setattr(store_mod, "TLS_CHECK_S", 0.2)
    live = tmp_path / "live"
    live.mkdir()
    ca, cert, key = live / "ca.pem", live / "client.pem", live / "client.key"

    def install(authority: CertAuthority, client: CertPair) -> None:
        for src, dst in ((authority.cert, ca), (client.cert, cert), (client.key, key)):
            tmp = dst.with_suffix(".new")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)  # as cert-manager and certbot do: a rename over the file

    install(pki.ca, pki.client)
    server = _start(pki, tmp_path / "etcd")
    new_ca = CertAuthority.create(tmp_path / "new", "rotated-ca")
    new_server, new_client = new_ca.server(), new_ca.client("node-client")
    cfg = EtcdConfig(endpoints=config.parse_endpoints(server.endpoint), ca=ca, cert=cert,
                     key=key, timeout=1.0)

    async def put_until(store: EtcdStore, key_: str, within: float) -> float:
        t0 = time.monotonic()
        while True:
            try:
                await store.put(f"{PREFIX}/t/{key_}", b"1")
                return time.monotonic() - t0
            except StoreError:
                if time.monotonic() - t0 > within:
                    raise
                await asyncio.sleep(0.1)

    async def run() -> None:
        store = EtcdStore(cfg)
        try:
            await store.put(f"{PREFIX}/t/before", b"1")
            server.tls = TlsFiles(new_ca.cert, new_server.cert, new_server.key)
            server.restart()
            with pytest.raises(StoreError):  # the old CA does not trust the new server
                await store.put(f"{PREFIX}/t/old-files", b"1")
            # Half-way: the new certificate with the old key. Refused, the old set kept.
            shutil.copyfile(new_client.cert, cert)
            await asyncio.sleep(0.3)
            with pytest.raises(StoreError):
                await store.put(f"{PREFIX}/t/half", b"1")
            assert store._tls_refused is not None
            install(new_ca, new_client)
            await put_until(store, "after", within=5.0)
        finally:
            await store.close()

    try:
        asyncio.run(run())
    finally:
        server.cleanup()


# -- auth: the store ------------------------------------------------------------------------


def test_store_user_and_password_over_tls(auth_etcd: EmbeddedEtcd, pki: Pki) -> None:
    async def run() -> None:
        store = EtcdStore(_cfg(auth_etcd, pki.ca.cert, pki.client, "understudy", PASSWORD))
        try:
            lease = await store.grant(2)
            await store.put(f"{PREFIX}/t/a", b"1", lease=lease)
            assert await store.keepalive(lease) >= 1
            kvs, rev = await store.get_prefix(f"{PREFIX}/t/")
            assert [k.key for k in kvs] == [f"{PREFIX}/t/a"]
            await store.revoke(lease)  # etcd checks write permission on the lease's keys
            # Outside the granted prefix: refused, one sentence.
            with pytest.raises(StoreError, match="permission denied") as info:
                await store.put("/elsewhere", b"x")
            _one_sentence(str(info.value))
            # A watch inside the prefix works with the token.
            stop = asyncio.Event()
            seen = []

            async def watch() -> None:
                async for ev in store.watch_prefix(f"{PREFIX}/t/", rev + 1, stop):
                    seen.append(ev)
                    stop.set()

            task = asyncio.create_task(watch())
            await store.put(f"{PREFIX}/t/b", b"2")
            await asyncio.wait_for(task, 5)
            assert seen, "the watch delivered nothing"
        finally:
            await store.close()

    asyncio.run(run())


def test_every_store_call_the_daemon_makes_stays_inside_the_cluster_prefix(
        auth_etcd: EmbeddedEtcd, pki: Pki) -> None:
    """A role with readwrite on ``<prefix>/`` only is enough for everything the daemon does."""
    keys = Keys(PREFIX)

    async def run() -> None:
        store = EtcdStore(_cfg(auth_etcd, pki.ca.cert, pki.client, "understudy", PASSWORD))
        try:
            lease = await store.grant(3)
            assert await store.cas(keys.node("n1"), b"rec", 0, lease=lease)
            assert await store.txn(compare=[("create", keys.registry_entry("n1"), 0)],
                                   success=[("put", keys.registry_entry("n1"), b"e", None)])
            assert await store.cas(keys.controller, b"n1", 0, lease=lease)
            await store.put(keys.event("e1"), b"ev")
            await store.put(keys.kv("job") + "a", b"v")
            for collection in (keys.nodes, keys.registry, keys.drains, keys.events,
                               keys.kv("job"), keys.controller):
                await store.get_prefix(collection)
            assert await store.get(keys.drain("n1")) is None
            stop = asyncio.Event()
            _, rev = await store.get_prefix(keys.controller)

            async def watch() -> None:
                async for _ in store.watch_prefix(keys.controller, rev + 1, stop):
                    stop.set()

            task = asyncio.create_task(watch())
            await asyncio.sleep(0.1)
            assert await store.delete(keys.controller)
            await asyncio.wait_for(task, 5)
            assert await store.keepalive(lease) >= 1
            await store.delete_prefix(keys.kv("job"))
            await store.revoke(lease)
        finally:
            await store.close()

    asyncio.run(run())


def test_current_revision_works_for_a_role_limited_to_the_cluster_prefix(
        auth_etcd: EmbeddedEtcd, pki: Pki) -> None:
    async def run() -> None:
        store = EtcdStore(_cfg(auth_etcd, pki.ca.cert, pki.client, "understudy", PASSWORD))
        try:
            rev = await store.put(f"{PREFIX}/t/k", b"1")
            assert await store.current_revision() >= rev
        finally:
            await store.close()

    asyncio.run(run())


def test_store_wrong_password_and_missing_permission_are_refused(auth_etcd: EmbeddedEtcd,
                                                                 pki: Pki) -> None:
    message, took = _refusal(_cfg(auth_etcd, pki.ca.cert, pki.client, "understudy", "wrong"))
    _one_sentence(message)
    assert "authentication failed" in message and took < 1.5, message
    message, _ = _refusal(_cfg(auth_etcd, pki.ca.cert, pki.client, "outsider",
                               OUTSIDER_PASSWORD))
    _one_sentence(message)
    assert "permission denied" in message, message
    # Nothing was written by either.
    res = etcdctl(auth_etcd, pki, "get", "--prefix", f"{PREFIX}/", user=f"root:{ROOT_PASSWORD}")
    assert res.returncode == 0 and res.stdout == "", res.stdout + res.stderr


def test_etcd_takes_the_user_from_the_certificate_cn_when_no_password_is_given(
        auth_etcd: EmbeddedEtcd, pki: Pki) -> None:
    """etcd 3.4 with --client-cert-auth: no token means "the user named by the CN", with no
    password check. A token (user + password) wins over the CN."""

    async def run() -> None:
        # CN "understudy" is a user: its role applies, no password needed.
        named = EtcdStore(_cfg(auth_etcd, pki.ca.cert, pki.named_client))
        # CN "node-client" is no user: refused.
        anonymous = EtcdStore(_cfg(auth_etcd, pki.ca.cert, pki.client))
        # CN "understudy" but logged in as outsider: outsider's (lack of) rights apply.
        token_wins = EtcdStore(_cfg(auth_etcd, pki.ca.cert, pki.named_client, "outsider",
                                    OUTSIDER_PASSWORD))
        try:
            await named.put(f"{PREFIX}/t/by-cn", b"1")
            assert (await named.get(f"{PREFIX}/t/by-cn")) is not None
            with pytest.raises(StoreError, match="permission denied"):
                await named.put("/elsewhere", b"x")
            with pytest.raises(StoreError, match="permission denied"):
                await anonymous.get(f"{PREFIX}/t/by-cn")
            with pytest.raises(StoreError, match="permission denied"):
                await token_wins.get(f"{PREFIX}/t/by-cn")
        finally:
            for s in (named, anonymous, token_wins):
                await s.close()

    asyncio.run(run())


def test_store_logs_in_again_when_its_token_expires(pki: Pki, tmp_path: Path) -> None:
    server = _start(pki, tmp_path / "etcd", extra=["--auth-token-ttl=1"])
    try:
        enable_auth(server, pki)

        async def run() -> None:
            store = EtcdStore(_cfg(server, pki.ca.cert, pki.client, "understudy", PASSWORD))
            try:
                await store.put(f"{PREFIX}/t/k", b"1")
                await asyncio.sleep(2.2)  # the simple token expires after 1s idle
                # At most one call is refused ("invalid auth token"); the next logs in again.
                for attempt in range(2):
                    try:
                        assert await store.get(f"{PREFIX}/t/k") is not None
                        return
                    except StoreError as exc:
                        assert attempt == 0 and "invalid auth token" in str(exc), exc
                raise AssertionError("unreachable")
            finally:
                await store.close()

        asyncio.run(run())
    finally:
        server.cleanup()


# -- end to end: daemons and CLI ------------------------------------------------------------


@dataclass
class SecureCluster(LocalCluster):
    """LocalCluster whose own status reads and CLI calls use TLS and a password login."""

    etcd_cfg: EtcdConfig | None = None
    cli_env: dict[str, str] = field(default_factory=dict)
    cli_flags: tuple[str, ...] = ()

    def cli(self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.python, "-m", "understudy.cli.main", "--etcd", self.etcd_endpoint,
             "--prefix", self.prefix, *self.cli_flags, *args],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, **self.cli_env, **(env or {})},
        )

    def etcd_config(self) -> EtcdConfig:
        assert self.etcd_cfg is not None
        return self.etcd_cfg


def _daemon_env(pki: Pki, user: str, password: str) -> dict[str, str]:
    return {env_vars.ETCD_CA: str(pki.ca.cert), env_vars.ETCD_CERT: str(pki.client.cert),
            env_vars.ETCD_KEY: str(pki.client.key), env_vars.ETCD_USER: user,
            env_vars.ETCD_PASSWORD: password}


@pytest.fixture
def cluster(auth_etcd: EmbeddedEtcd, pki: Pki, tmp_path: Path) -> Iterator[SecureCluster]:
    c = SecureCluster(
        etcd_endpoint=auth_etcd.endpoint, base_dir=tmp_path / "cluster", prefix=PREFIX,
        etcd_cfg=_cfg(auth_etcd, pki.ca.cert, pki.client, "understudy", PASSWORD),
        cli_flags=("--ca", str(pki.ca.cert), "--cert", str(pki.client.cert),
                   "--key", str(pki.client.key), "--user", "understudy"),
        cli_env={env_vars.ETCD_PASSWORD: PASSWORD},
    )
    try:
        yield c
    finally:
        c.stop_all(timeout=5, drain=False)
        for name, d in c.daemons.items():
            assert "Traceback" not in d.log_text(), f"{name} logged a traceback"


def test_daemons_and_cli_over_tls_and_auth(cluster: SecureCluster, pki: Pki,
                                          tmp_path: Path) -> None:
    # node-a: TLS and login from the environment.
    cluster.add("node-a", "active", env=_daemon_env(pki, "understudy", PASSWORD))
    # node-b: the same from a config file, with the password in a file (the systemd way).
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    conf = tmp_path / "node-b.toml"
    conf.write_text(f'[etcd]\nca = "{pki.ca.cert}"\ncert = "{pki.client.cert}"\n'
                    f'key = "{pki.client.key}"\nuser = "understudy"\n'
                    f'password_file = "{password_file}"\n')
    cluster.add("node-b", "active", extra=["--config", str(conf)])
    cluster.wait_state("node-a", "active", timeout=15)
    cluster.wait_state("node-b", "active", timeout=15)
    cluster.wait_for("a controller", lambda s: s.controller is not None, timeout=10)

    out = cluster.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {n["name"]: n["state"] for n in data["nodes"]} == {"node-a": "active",
                                                              "node-b": "active"}
    assert data["controller"] in ("node-a", "node-b")

    out = cluster.cli("drain", "node-b", "--deadline", "10", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "node-b: drained" in out.stdout
    node_b = cluster.status().node("node-b")
    assert node_b is not None and node_b.state == "drained"


def test_wrong_password_and_missing_permission_are_refused_clearly(
        cluster: SecureCluster, pki: Pki) -> None:
    # Daemons with bad credentials keep retrying and do not crash or write anything.
    cluster.add("node-w", "active", env=_daemon_env(pki, "understudy", "wrong-password"))
    cluster.add("node-o", "active", env=_daemon_env(pki, "outsider", OUTSIDER_PASSWORD))

    # The CLI: exit 1 and one sentence on stderr.
    wrong = cluster.cli("status", env={env_vars.ETCD_PASSWORD: "wrong-password"})
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    _one_sentence(wrong.stderr)
    assert wrong.stderr.startswith("understudy: ") and "authentication failed" in wrong.stderr
    outsider = cluster.cli("status", "--user", "outsider",
                           env={env_vars.ETCD_PASSWORD: OUTSIDER_PASSWORD})
    assert outsider.returncode == 1, outsider.stdout + outsider.stderr
    _one_sentence(outsider.stderr)
    assert "permission denied" in outsider.stderr
    no_password = cluster.cli("status", env={env_vars.ETCD_PASSWORD: ""})
    assert no_password.returncode == 2, no_password.stderr  # a configuration error
    _one_sentence(no_password.stderr)

    deadline = time.monotonic() + 10
    needles = {"node-w": "authentication failed", "node-o": "permission denied"}
    while time.monotonic() < deadline and not all(
            needle in cluster.daemons[n].log_text() for n, needle in needles.items()):
        time.sleep(0.1)
    for name, needle in needles.items():
        d = cluster.daemons[name]
        assert d.alive(), f"{name} exited: {d.log_text()[-2000:]}"
        assert needle in d.log_text() and "Cannot register with etcd yet" in d.log_text(), name
        # each failed try is counted (the log says it once)
        retries = value(scrape(d.metrics_port), "understudy_etcd_retries_total", call="register")
        assert retries is not None and retries >= 2, (name, retries)
    time.sleep(1.0)
    assert all(d.alive() for d in cluster.daemons.values())
    ok = cluster.cli("status", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["nodes"] == []

    # A first SIGTERM waits to drain a node that has joined; these never joined, so the second
    # ("stop now") is what ends them. Either way they exit cleanly.
    for d in cluster.daemons.values():
        d.signal(signal.SIGTERM)
    time.sleep(0.2)
    for d in cluster.daemons.values():
        d.signal(signal.SIGTERM)
    for name, d in cluster.daemons.items():
        assert d.wait(timeout=10) == 0, f"{name}: {d.log_text()[-2000:]}"


# -- the least-privilege roles of docs/security.md --------------------------------------------

#: user -> the role of docs/security.md it gets
ROLE_USERS = {"node": "understudy-node", "submitter": "understudy-submitter",
              "operator": "understudy-operator", "viewer": "understudy-viewer"}
PROBE = str(Path(__file__).parents[1] / "workers" / "probe.py")


def doc_role_commands() -> list[list[str]]:
    """The ``etcdctl role ...`` lines of docs/security.md, for the prefix ``PREFIX``."""
    text = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    out = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words[:2] == ["etcdctl", "role"]:
            out.append([w.replace("P/", f"{PREFIX}/") for w in words[1:]])
    assert len(out) > 10, "docs/security.md lost its etcdctl role commands"
    return out


def test_the_roles_of_docs_security_md_are_enough_and_no_more(auth_etcd: EmbeddedEtcd,
                                                              pki: Pki, tmp_path: Path) -> None:
    """Every command of the page, run as written: daemons with the node role register, elect
    a controller, run a job's workers and revoke a dead node's lease; the submitter runs a job,
    the operator cordons and drains, the viewer reads; the viewer may not drain and the
    operator may not run a job."""
    root = f"root:{ROOT_PASSWORD}"
    for cmd in doc_role_commands():
        res = etcdctl(auth_etcd, pki, *cmd, user=root)
        assert res.returncode == 0, f"etcdctl {' '.join(cmd)}: {res.stderr.strip()}"
    for user, role in ROLE_USERS.items():
        for cmd in (("user", "add", f"{user}:{user}-secret"),
                    ("user", "grant-role", user, role)):
            res = etcdctl(auth_etcd, pki, *cmd, user=root)
            assert res.returncode == 0, res.stderr
    c = SecureCluster(
        etcd_endpoint=auth_etcd.endpoint, base_dir=tmp_path / "cluster", prefix=PREFIX,
        etcd_cfg=_cfg(auth_etcd, pki.ca.cert, pki.client, "viewer", "viewer-secret"),
        cli_flags=("--ca", str(pki.ca.cert), "--cert", str(pki.client.cert),
                   "--key", str(pki.client.key)))

    def cli(command: str, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        return c.cli(command, "--user", user, *args,
                     env={env_vars.ETCD_PASSWORD: f"{user}-secret"})

    try:
        for name, role in (("node-a", "active"), ("node-s", "standby")):
            c.add(name, role, env=_daemon_env(pki, "node", "node-secret"))
        c.wait_state("node-a", "active", timeout=15)
        c.wait_state("node-s", "standby", timeout=15)
        c.wait_for("a controller", lambda s: s.controller is not None, timeout=15)
        leader = c.status().controller
        assert leader is not None
        victim = "node-s" if leader == "node-a" else "node-a"
        refused = cli("run", "operator", "--job", "j", "--tp", "1", "--dp", "1", "--",
                      sys.executable, PROBE)
        assert refused.returncode == 1 and "permission denied" in refused.stderr, refused
        ran = cli("run", "submitter", "--job", "j", "--tp", "1", "--dp", "1", "--",
                  sys.executable, PROBE)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        c.wait_for("j done", lambda s: s.job("j") is not None
                   and s.job("j").state == "done", timeout=60)  # type: ignore[union-attr]
        status = cli("status", "viewer", "--json")
        assert status.returncode == 0, status.stderr
        no_drain = cli("drain", "viewer", "node-s")
        assert no_drain.returncode == 1 and "permission denied" in no_drain.stderr, no_drain
        cordon = cli("cordon", "operator", victim)
        assert cordon.returncode == 0, cordon.stdout + cordon.stderr
        drained = cli("drain", "operator", victim, "--deadline", "10", "--wait")
        assert drained.returncode == 0 and f"{victim}: drained" in drained.stdout, drained
        # The controller revokes the lease of a node killed with -9: that needs write
        # permission on the keys bound to that lease.
        c.daemons[victim].kill9()
        wait_log(c.daemons[leader], f"Node {victim} is lost", timeout=15)
        log = c.daemons[leader].log_text()
        assert "Revoked its lease." in log and "Could not revoke" not in log
        assert "permission denied" not in log
    finally:
        c.stop_all(timeout=5, drain=False)
        for name, d in c.daemons.items():
            assert "Traceback" not in d.log_text(), f"{name} logged a traceback"
