-- Pause/resume: what a sandbox does when its timeout is reached.
ALTER TABLE sandboxes ADD COLUMN auto_pause INTEGER NOT NULL DEFAULT 0;

-- Snapshots a key made of its sandboxes (E2B's create_snapshot, `hutch snapshot`):
-- usable as a template id or name. Files live in `dir`.
CREATE TABLE snapshots (
    id              TEXT PRIMARY KEY,
    key_id          TEXT NOT NULL REFERENCES api_keys(id),
    name            TEXT,
    template        TEXT NOT NULL,
    source_sandbox  TEXT,
    memory          INTEGER NOT NULL,
    dir             TEXT NOT NULL,
    created_at      TEXT NOT NULL
);

CREATE UNIQUE INDEX snapshots_by_name ON snapshots (key_id, name);
