-- hutch's control-plane state. Plain SQL that SQLite and PostgreSQL both accept:
-- text timestamps (RFC 3339, UTC), JSON kept as text.
CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    key_hash    TEXT NOT NULL UNIQUE,
    created_at  TEXT NOT NULL,
    revoked_at  TEXT
);

CREATE TABLE sandboxes (
    id            TEXT PRIMARY KEY,
    key_id        TEXT NOT NULL REFERENCES api_keys(id),
    template      TEXT NOT NULL,
    state         TEXT NOT NULL,
    cpu_count     INTEGER NOT NULL,
    memory_mb     INTEGER NOT NULL,
    disk_mb       INTEGER NOT NULL,
    metadata      TEXT NOT NULL,
    env_vars      TEXT NOT NULL,
    envd_token    TEXT,
    started_at    TEXT NOT NULL,
    end_at        TEXT NOT NULL,
    qemu_pid      INTEGER,
    dir           TEXT NOT NULL
);

CREATE INDEX sandboxes_by_key ON sandboxes (key_id, started_at);
