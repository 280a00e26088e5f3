"""Keys and tenants reloaded from their files without a restart (reload.py): a Secret updated
the way Kubernetes does it (a `..data` symlink swapped to a new directory), a file edited in
place, a bad file refused with the old configuration kept."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mineru_gateway.api.tenants import TenantDirectory
from mineru_gateway.config import GatewaySettings
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.reload import APPLIED, REFUSED, CredentialWatcher
from tests.conftest import StartGateway, StartSim
from tests.support.servers import wait_until

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
WATCH_S = 10.0  # the promise: a change takes effect within this


class SecretVolume:
    """A directory laid out as the kubelet lays out a mounted Secret: each version in a
    directory of its own, `..data` a symlink to the current one, each key a symlink through
    `..data`. An update writes a new directory and renames a new link over `..data`."""

    def __init__(self, root: Path, files: dict[str, str]) -> None:
        self.root = root
        self.versions = 0
        self.update(files)
        for name in files:
            (root / name).symlink_to(Path("..data") / name)

    def update(self, files: dict[str, str]) -> None:
        self.versions += 1
        version = self.root / f"..2026_01_01_00_00_{self.versions:02d}.000000001"
        version.mkdir()
        for name, text in files.items():
            (version / name).write_text(text)
        staged = self.root / "..data_tmp"
        staged.symlink_to(version.name)
        os.replace(staged, self.root / "..data")  # the atomic swap

    def path(self, name: str) -> Path:
        return self.root / name


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def reloads(gateway: str) -> dict[str, float]:
    text = httpx.get(gateway + "/metrics").text
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mineru_gateway_config_reload_total"
    }


def status(gateway: str, key: str) -> int:
    return httpx.post(gateway + CHAT, json=BODY, headers=bearer(key), timeout=30).status_code


def test_a_key_rotated_kubernetes_style_under_load_takes_effect_without_a_failed_request(
    tmp_path: Path, start_sim: StartSim, start_gateway: StartGateway
) -> None:
    secret = SecretVolume(tmp_path, {"api-keys": "steady-key\nold-key\n"})
    worker = start_sim(model_name="tiny")
    gateway = start_gateway(
        [worker], api_key_files=[str(secret.path("api-keys"))], reload_interval_s=0.2
    )
    assert status(gateway, "old-key") == 200 and status(gateway, "new-key") == 401

    failures: list[int] = []
    sent = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal sent
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                answer = client.post(gateway + CHAT, json=BODY, headers=bearer("steady-key"))
                sent += 1
                if answer.status_code != 200:
                    failures.append(answer.status_code)

    loaders = [threading.Thread(target=load) for _ in range(4)]
    for loader in loaders:
        loader.start()
    try:
        wait_until(lambda: sent >= 20, 30.0, "load running")
        secret.update({"api-keys": "steady-key\nnew-key\n"})
        wait_until(lambda: status(gateway, "new-key") == 200, WATCH_S, "the new key accepted")
        assert status(gateway, "old-key") == 401
        at_swap = sent
        wait_until(lambda: sent >= at_swap + 20, 30.0, "load after the swap")
    finally:
        stop.set()
        for loader in loaders:
            loader.join(timeout=30)
    assert failures == []
    assert reloads(gateway) == {APPLIED: 1.0}


def test_a_bad_tenants_file_is_refused_and_the_old_tenants_stay(
    tmp_path: Path, start_sim: StartSim, start_gateway: StartGateway
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.batch]\nkeys = ["sk-batch"]\n')
    worker = start_sim(model_name="tiny")
    gateway = start_gateway([worker], tenants_file=str(tenants), reload_interval_s=0.2)
    assert status(gateway, "sk-batch") == 200

    tenants.write_text('[tenants.batch]\nkeys = ["sk-batch"]\nweight = -1\n')  # edited in place
    wait_until(lambda: reloads(gateway).get(REFUSED) == 1.0, WATCH_S, "the bad file refused")
    assert status(gateway, "sk-batch") == 200

    tenants.write_text("[tenants.batch\n")  # not TOML at all
    wait_until(lambda: reloads(gateway).get(REFUSED) == 2.0, WATCH_S, "the broken file refused")
    assert status(gateway, "sk-batch") == 200

    tenants.write_text('[tenants.batch]\nkeys = ["sk-batch-2"]\nweight = 3\n')
    wait_until(lambda: status(gateway, "sk-batch-2") == 200, WATCH_S, "the good file applied")
    assert status(gateway, "sk-batch") == 401
    assert reloads(gateway) == {REFUSED: 2.0, APPLIED: 1.0}


def test_an_admin_key_file_edited_in_place_changes_the_admin_key(
    tmp_path: Path, start_gateway: StartGateway
) -> None:
    admin = tmp_path / "admin-keys"
    admin.write_text("adm-1\n")
    gateway = start_gateway(
        ["http://127.0.0.1:9"], admin_key_files=[str(admin)], reload_interval_s=0.2
    )
    assert httpx.get(gateway + "/v1/usage", headers=bearer("adm-1")).status_code == 200
    admin.write_text("adm-2\n")
    wait_until(
        lambda: httpx.get(gateway + "/v1/usage", headers=bearer("adm-2")).status_code == 200,
        WATCH_S,
        "the new admin key",
    )
    assert httpx.get(gateway + "/v1/usage", headers=bearer("adm-1")).status_code == 403


def test_a_request_keeps_the_tenant_it_was_admitted_under(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"batch": {"keys": ["sk-b"], "weight": 1}}')
    settings = GatewaySettings(tenants_file=tenants, reload_interval_s=0.2)
    directory = TenantDirectory(settings)
    metrics = GatewayMetrics()
    watcher = CredentialWatcher(settings, directory, metrics.config_reloads)
    admitted = directory.authenticate(b"Bearer sk-b")

    tenants.write_text('{"batch": {"keys": ["sk-b"], "weight": 5}}')
    assert watcher.check() is None  # a change is applied once two looks agree
    assert watcher.check() == APPLIED
    assert (admitted.name, admitted.weight) == ("batch", 1.0)
    assert directory.authenticate(b"Bearer sk-b").weight == 5.0
    assert watcher.check() is None  # nothing changed since


def test_a_client_key_that_is_also_an_admin_key_is_refused(tmp_path: Path) -> None:
    keys, admin = tmp_path / "keys", tmp_path / "admin"
    keys.write_text("client\n")
    admin.write_text("adm\n")
    settings = GatewaySettings(api_key_files=[keys], admin_key_files=[admin])
    directory = TenantDirectory(settings)
    watcher = CredentialWatcher(settings, directory, GatewayMetrics().config_reloads)
    keys.write_text("client\nadm\n")
    watcher.check()
    assert watcher.check() == REFUSED
    assert settings.client_keys == ("client",) and settings.all_admin_keys == ("adm",)


@pytest.mark.parametrize("gone", ["missing", "unreadable"])
def test_a_key_file_that_disappears_is_refused(tmp_path: Path, gone: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text("client\n")
    settings = GatewaySettings(api_key_files=[keys])
    directory = TenantDirectory(settings)
    watcher = CredentialWatcher(settings, directory, GatewayMetrics().config_reloads)
    if gone == "missing":
        keys.unlink()
    else:
        keys.unlink()
        keys.mkdir()  # a directory where the file was: reading it fails
    watcher.check()
    assert watcher.check() == REFUSED
    assert directory.authenticate(b"Bearer client").name.startswith("key-")
