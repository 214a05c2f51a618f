//! Query strings with repeated keys and nested encodings (E2B's `metadata=k%3Dv`).

use percent_encoding::percent_decode_str;

/// One component decoded the way `application/x-www-form-urlencoded` decodes names and
/// values (`+` is a space, then percent-decoding, lossy UTF-8), with no splitting on
/// `&` or `=`.
pub fn decode(s: &str) -> String {
    percent_decode_str(&s.replace('+', " ")).decode_utf8_lossy().into_owned()
}

/// All `key=value` pairs, decoded, in order.
pub fn pairs(query: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(query.unwrap_or("").as_bytes()).into_owned().collect()
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
