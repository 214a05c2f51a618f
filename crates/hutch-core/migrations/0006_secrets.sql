-- Secrets (E2B's /secrets), per API key: names and metadata in the clear, the current
-- version's value sealed (AES-256-GCM) under a key kept outside the database
-- (secrets/keys/<key_gen>.key in the home). Older versions' values are not kept.
CREATE TABLE secrets (
    id              TEXT PRIMARY KEY,
    key_id          TEXT NOT NULL REFERENCES api_keys(id),
    name            TEXT NOT NULL,
    current_version INTEGER NOT NULL,
    metadata        TEXT NOT NULL,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL,
    key_gen         INTEGER NOT NULL,
    nonce           BLOB NOT NULL,
    ciphertext      BLOB NOT NULL,
    UNIQUE (key_id, name)
);
