-- E2B's autoPauseMemory: false makes the timeout's auto-pause keep only the disk.
ALTER TABLE sandboxes ADD COLUMN auto_pause_memory BOOLEAN NOT NULL DEFAULT TRUE;
