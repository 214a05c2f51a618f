//! Query strings with repeated keys and nested encodings (E2B's `metadata=k%3Dv`).

use percent_encoding::percent_decode_str;

pub fn decode(s: &str) -> String {
    percent_decode_str(&s.replace('+', " ")).decode_utf8_lossy().into_owned()
}

/// All `key=value` pairs, decoded, in order.
pub fn pairs(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_metadata() {
        let p = pairs(Some("metadata=k%3Dv%26a%3Db&state=running,paused&limit=10"));
        assert_eq!(p[0], ("metadata".into(), "k=v&a=b".into()));
        let inner = pairs(Some(&p[0].1));
        assert_eq!(inner, [("k".into(), "v".into()), ("a".into(), "b".into())]);
        assert_eq!(p[1].1, "running,paused");
    }
}
