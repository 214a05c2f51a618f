"""E2B's secrets API through the official SDK's `Secret` class, unchanged: a value goes
in and never comes back out (not in a body, a header, an error, the server's log or its
database file), each API key sees only its own, and listing pages as the SDK reads it.
No sandbox is involved."""

import os
import subprocess

import httpx
import pytest
from e2b import Secret
from e2b.exceptions import SecretException, SecretNotFoundException

from conftest import HUTCH

VALUE = "sk-hutch-test-3f9a1c0e7b"
NEW_VALUE = "sk-hutch-test-rotated-88d2"


def other_key(server) -> str:
    out = subprocess.run([str(HUTCH), "keys", "create", "--name", "secrets-other"], env=dict(os.environ, HUTCH_HOME=str(server.home)),
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture
def openai():
    info = Secret.create(" OpenAI-Key ", VALUE, metadata={"team": "ml"})
    yield info
    Secret.destroy(info.secret_id)


def test_a_secret_lives_its_life_through_the_official_sdk(server, openai):
    assert openai.secret_id.startswith("sec_") and len(openai.secret_id) == 30
    assert (openai.name, openai.version, openai.metadata) == ("openai-key", 1, {"team": "ml"})
    assert openai.created_at == openai.updated_at and openai.created_at.tzinfo is not None
    for selector in (openai.secret_id, "openai-key", "OPENAI-KEY"):
        assert Secret.get_info(selector) == openai
        assert Secret.exists(selector)

    updated = Secret.update("openai-key", NEW_VALUE)
    assert (updated.version, updated.metadata, updated.created_at) == (2, {"team": "ml"}, openai.created_at)
    assert updated.updated_at > openai.updated_at
    cleared = Secret.update(openai.secret_id, NEW_VALUE, metadata={})
    assert (cleared.version, cleared.metadata) == (3, {})

    with pytest.raises(SecretException) as taken:
        Secret.create("openai-key", "other")
    assert "exists" in str(taken.value)
    with pytest.raises(SecretNotFoundException):
        Secret.update("nope", "x")
    assert not Secret.exists("nope")
    assert not Secret.exists("sec_" + "0" * 26)


def test_listing_pages_as_the_sdk_reads_them(server):
    made = [Secret.create(f"page-{i}", VALUE) for i in range(3)]
    try:
        paginator = Secret.list(limit=2)
        seen = []
        while paginator.has_next:
            page = paginator.next_items()
            assert len(page) <= 2
            seen += [s.secret_id for s in page]
        assert [s.secret_id for s in made] == [i for i in seen if i in {s.secret_id for s in made}]
    finally:
        for s in made:
            assert Secret.destroy(s.secret_id)
    assert not Secret.destroy(made[0].secret_id), "a second destroy found it"


def test_a_value_is_never_shown_and_another_key_sees_nothing(server, openai):
    api = server.api()
    for resp in (api.get("/secrets"), api.get(f"/secrets/{openai.secret_id}"), api.get("/secrets/openai-key")):
        assert resp.status_code == 200 and resp.headers["cache-control"] == "no-store", resp.text
        assert VALUE not in resp.text and VALUE not in str(resp.headers)
    # Bad requests say what is wrong without quoting what was sent.
    for body in ({"name": "bad name!", "value": VALUE}, {"name": "ok-name", "value": 12345}, {"name": "sec_x", "value": VALUE}, {"name": VALUE}):
        resp = api.post("/secrets", json=body)
        assert resp.status_code == 400 and resp.json()["message"].startswith("Invalid secrets request"), resp.text
        assert VALUE not in resp.text and "12345" not in resp.text and resp.headers["cache-control"] == "no-store"
    assert api.get("/secrets?limit=0").status_code == 400
    assert api.get("/secrets?nextToken=whatever").status_code == 400

    other = httpx.Client(base_url=server.url, headers={"X-API-Key": other_key(server)})
    assert other.get("/secrets").json() == []
    for selector in (openai.secret_id, "openai-key"):
        assert other.get(f"/secrets/{selector}").status_code == 404
        assert other.post(f"/secrets/{selector}", json={"value": "stolen"}).status_code == 404
        assert other.delete(f"/secrets/{selector}").status_code == 404
    # The other key's own secret of the same name is its own.
    mine = other.post("/secrets", json={"name": "openai-key", "value": NEW_VALUE})
    assert mine.status_code == 201 and mine.json()["secretID"] != openai.secret_id, mine.text
    assert other.delete(f"/secrets/{mine.json()['secretID']}").status_code == 204
    assert Secret.get_info(openai.secret_id) == openai

    # Neither the server's log nor its database file holds a value; the key that seals
    # them is the server's alone.
    for path in [server.home / "hutch.db", server.home / "hutch.db-wal", server.home / "serve.log"]:
        if path.exists():
            data = path.read_bytes()
            assert VALUE.encode() not in data and NEW_VALUE.encode() not in data, f"a value is in {path}"
    keys = server.home / "secrets" / "keys"
    assert oct(keys.stat().st_mode & 0o777) == "0o700"
    assert all(oct(k.stat().st_mode & 0o777) == "0o600" for k in keys.glob("*.key"))
