-- E2B's autoResume: data-plane traffic to the paused sandbox resumes it.
ALTER TABLE sandboxes ADD COLUMN auto_resume BOOLEAN NOT NULL DEFAULT FALSE;
