-- E2B's allowPublicTraffic: false. Port traffic to the sandbox must carry this token
-- in `e2b-traffic-access-token`; NULL means its ports are public.
ALTER TABLE sandboxes ADD COLUMN traffic_token TEXT;
