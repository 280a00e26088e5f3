"""API keys to tenants: named tenants from settings and files, one tenant per other key."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from mineru_gateway.api.tenants import DEFAULT_TENANT, TenantDirectory
from mineru_gateway.config import GatewaySettings
from mineru_gateway.errors import AuthenticationFailed

pytestmark = pytest.mark.unit

TENANTS_DOC = Path(__file__).resolve().parents[2] / "docs" / "flow-control.md"


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_without_keys_everyone_is_the_default_tenant() -> None:
    directory = TenantDirectory(GatewaySettings())
    assert not directory.keys_required
    assert directory.authenticate(None).name == DEFAULT_TENANT
    assert directory.authenticate(bearer("anything")).name == DEFAULT_TENANT
    assert set(directory.policies()) == {DEFAULT_TENANT}


def test_each_api_key_is_a_tenant_named_by_a_hash_of_it() -> None:
    settings = GatewaySettings(api_keys="k1,k2", tenant_max_queued=7, tenant_max_in_flight=3)
    directory = TenantDirectory(settings)
    first = directory.authenticate(bearer("k1"))
    assert first.name == "key-" + hashlib.sha256(b"k1").hexdigest()[:8]
    assert (first.max_queued, first.max_in_flight, first.weight) == (7, 3, 1.0)
    assert directory.authenticate(bearer("k2")).name != first.name
    assert "k1" not in "".join(directory.policies())  # the key itself is never a name


@pytest.mark.parametrize("header", [None, b"", b"Bearer", b"Bearer wrong", b"Basic k1", b"k1"])
def test_a_missing_or_wrong_key_is_refused(header: bytes | None) -> None:
    directory = TenantDirectory(GatewaySettings(api_keys="k1"))
    with pytest.raises(AuthenticationFailed):
        directory.authenticate(header)


def test_named_tenants_from_a_toml_file_with_key_files(tmp_path: Path) -> None:
    secret = tmp_path / "interactive-key"
    secret.write_text("sk-secret\n\n")
    config = tmp_path / "tenants.toml"
    config.write_text(
        "[tenants.batch]\n"
        'keys = ["sk-b1", "sk-b2"]\n'
        "max_in_flight = 200\n"
        "[tenants.interactive]\n"
        f'key_files = ["{secret}"]\n'
        "weight = 4\n"
        "priority = -1\n"
        "min_priority = -1\n"
    )
    settings = GatewaySettings(tenants_file=config, api_keys="sk-plain", tenant_max_queued=9)
    directory = TenantDirectory(settings)
    batch = directory.authenticate(bearer("sk-b2"))
    assert (batch.name, batch.max_in_flight, batch.max_queued) == ("batch", 200, 9)
    interactive = directory.authenticate(bearer("sk-secret"))
    assert (interactive.weight, interactive.priority) == (4.0, -1)
    assert interactive.effective_priority(-5) == -1 and interactive.effective_priority(3) == 3
    assert directory.authenticate(bearer("sk-plain")).name.startswith("key-")
    assert directory.priority_label(-1) == "-1" and directory.priority_label(77) == "other"


def test_tenants_in_json_override_the_file_by_name(tmp_path: Path) -> None:
    config = tmp_path / "tenants.json"
    config.write_text('{"batch": {"keys": ["a"], "weight": 2}, "other": {"keys": ["b"]}}')
    settings = GatewaySettings(
        tenants_file=config, tenants='{"batch": {"keys": ["c"], "weight": 3}}'
    )
    directory = TenantDirectory(settings)
    assert directory.authenticate(bearer("c")).weight == 3.0
    assert directory.authenticate(bearer("b")).name == "other"
    with pytest.raises(AuthenticationFailed):
        directory.authenticate(bearer("a"))


def test_a_bad_tenant_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        GatewaySettings(tenants='{"t": {"keys": ["k"], "weight": 0}}')
    with pytest.raises(ValueError, match="Extra inputs"):
        GatewaySettings(tenants='{"t": {"key": "k"}}')


def test_the_documented_example_is_a_valid_tenants_file(tmp_path: Path) -> None:
    example = re.search(r"```toml\n(.*?)```", TENANTS_DOC.read_text(), re.S)
    assert example is not None
    secret = tmp_path / "key"
    secret.write_text("sk-interactive")
    text = example.group(1).replace("/run/secrets/interactive-key", str(secret))
    (tmp_path / "tenants.toml").write_text(text)
    settings = GatewaySettings(tenants_file=tmp_path / "tenants.toml")
    assert set(settings.tenant_configs) == {"batch", "interactive"}
    directory = TenantDirectory(settings)
    assert directory.authenticate(bearer("sk-interactive")).name == "interactive"


def test_client_and_admin_keys_can_come_from_files(tmp_path: Path) -> None:
    """Docker and Kubernetes mount secrets as files: one key per line, comments skipped."""
    clients, admins = tmp_path / "clients", tmp_path / "admins"
    clients.write_text("# client keys\nsk-file-1\n\nsk-file-2\n")
    admins.write_text("adm-file\n")
    settings = GatewaySettings(
        api_keys="sk-env", api_key_files=str(clients), admin_key_files=str(admins)
    )
    assert settings.client_keys == ("sk-env", "sk-file-1", "sk-file-2")
    assert settings.all_admin_keys == ("adm-file",)
    directory = TenantDirectory(settings)
    assert directory.authenticate(bearer("sk-file-2")).name.startswith("key-")
    with pytest.raises(AuthenticationFailed):
        directory.authenticate(bearer("adm-file"))  # an admin key is not a client key
    admins.write_text("sk-file-1\n")
    with pytest.raises(ValueError, match="admin_keys must differ"):
        GatewaySettings(api_key_files=str(clients), admin_key_files=str(admins))
