-- The key generations that sealed this database's secrets, by fingerprint (an HMAC of
-- a fixed text under the key): a key directory that is missing, or another home's, is
-- refused rather than replaced by a new key that opens nothing stored.
CREATE TABLE secret_keys (
    generation  INTEGER PRIMARY KEY,
    fingerprint TEXT NOT NULL
);
