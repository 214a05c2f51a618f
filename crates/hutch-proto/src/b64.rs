//! proto3 JSON `bytes`: standard base64 out; standard or URL-safe, padded or not, in.

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine;
use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serializer};

pub fn encode(data: &[u8]) -> String {
    STANDARD.encode(data)
}

pub fn decode(text: &str) -> Result<Vec<u8>, base64::DecodeError> {
    STANDARD
        .decode(text)
        .or_else(|_| STANDARD_NO_PAD.decode(text))
        .or_else(|_| URL_SAFE.decode(text))
        .or_else(|_| URL_SAFE_NO_PAD.decode(text))
}

pub fn serialize<S: Serializer>(data: &Bytes, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&encode(data))
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
    let text = String::deserialize(d)?;
    decode(&text).map(Bytes::from).map_err(serde::de::Error::custom)
}
