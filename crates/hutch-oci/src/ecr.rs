//! Logging in to Amazon ECR as E2B's `fromAWSRegistry` does: the access key signs a
//! `GetAuthorizationToken` call to ECR's API (AWS Signature Version 4), whose answer is
//! a base64 `AWS:<password>` good for 12 hours; the pull then uses it as a basic login.
//!
//! The signer is written here rather than taken from `aws-sigv4`: it signs one fixed
//! request shape (a JSON POST to `/`, no query, four headers), which is a dozen lines of
//! HMAC over `hmac` + `sha2`, while `aws-sigv4` (with `aws-credential-types`, its
//! `sign-http` feature only) brings the Smithy runtime's types: 17 crates hutch does not
//! build today (`cargo tree`, 2026-12-06), five of them `aws-smithy-*`. It is checked
//! against AWS's own SigV4 test suite (`post-vanilla`) and against curl's independent
//! `--aws-sigv4` signer. It does not percent-encode the path (SigV4 encodes each
//! segment): it signs only paths that need none, which ECR's `/` is.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::time::{Duration, SystemTime};

/// How long the token call may take, connect included.
const DEADLINE: Duration = Duration::from_secs(15);
const TARGET: &str = "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken";
const CONTENT_TYPE: &str = "application/x-amz-json-1.1";

/// An AWS access key and the region whose ECR it logs in to.
#[derive(Clone)]
pub struct AwsLogin {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub region: String,
    /// Where the token call goes instead of `https://api.ecr.<region>.amazonaws.com/`
    /// (tests only: a loopback stand-in).
    pub endpoint: Option<String>,
}

/// Shown without the secret.
impl std::fmt::Debug for AwsLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsLogin").field("access_key_id", &self.access_key_id).field("region", &self.region).finish_non_exhaustive()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EcrError {
    #[error("`{0}` is not an AWS region (lowercase letters, digits and dashes, e.g. us-east-1)")]
    BadRegion(String),
    #[error("an AWS access key id (16-128 uppercase letters and digits) and its secret access key are both needed to log in to ECR")]
    MissingKey,
    #[error("an AWS login is for ECR registries (ACCOUNT.dkr.ecr.{region}.amazonaws.com); `{host}` is not one of that region's")]
    NotEcr { host: String, region: String },
    #[error("ECR's API ({endpoint}) could not be reached: {reason}")]
    Unreachable { endpoint: String, reason: String },
    #[error("AWS refused the ECR login ({status}: {message}); check the access key, its secret and the region, and that the key may call ecr:GetAuthorizationToken")]
    Refused { status: u16, message: String },
    #[error("ECR's API answered something that is not an authorization token: {0}")]
    BadAnswer(String),
}

impl AwsLogin {
    /// A region that can only name one of AWS's own hosts, and a whole key: checked
    /// before any call, and by the API when the build is asked for.
    pub fn check(&self) -> Result<(), EcrError> {
        let region_ok = !self.region.is_empty()
            && self.region.len() <= 32
            && self.region.starts_with(|c: char| c.is_ascii_lowercase())
            && self.region.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !region_ok {
            return Err(EcrError::BadRegion(self.region.clone()));
        }
        let key_ok = (16..=128).contains(&self.access_key_id.len()) && self.access_key_id.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit());
        if !key_ok || self.secret_access_key.is_empty() || self.secret_access_key.chars().any(char::is_control) {
            return Err(EcrError::MissingKey);
        }
        Ok(())
    }

    /// AWS's domain for the region (China's regions have their own).
    fn domain(&self) -> &'static str {
        if self.region.starts_with("cn-") {
            "amazonaws.com.cn"
        } else {
            "amazonaws.com"
        }
    }

    /// The registry `host` is one of this region's ECR registries, so the token (good
    /// for 12 hours) goes nowhere else. A stand-in endpoint (tests) takes any host.
    pub fn check_registry(&self, host: &str) -> Result<(), EcrError> {
        let suffix = format!(".dkr.ecr.{}.{}", self.region, self.domain());
        let host = host.to_ascii_lowercase();
        let account = host.strip_suffix(&suffix).unwrap_or("");
        let fits = !account.is_empty() && account.bytes().all(|b| b.is_ascii_digit() || b == b'-' || b.is_ascii_lowercase());
        if fits || self.endpoint.is_some() {
            Ok(())
        } else {
            Err(EcrError::NotEcr { host, region: self.region.clone() })
        }
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone().unwrap_or_else(|| format!("https://api.ecr.{}.{}/", self.region, self.domain()))
    }

    /// The registry user and password (`AWS`, a 12-hour token) for this key's ECR,
    /// through `proxy` when one is given (the server's builds).
    pub async fn login(&self, proxy: Option<&str>) -> Result<(String, String), EcrError> {
        self.check()?;
        let endpoint = self.endpoint();
        let unreachable = |e: reqwest::Error| EcrError::Unreachable { endpoint: endpoint.clone(), reason: hutch_proto::error_chain(&e) };
        let url = reqwest::Url::parse(&endpoint).map_err(|e| EcrError::Unreachable { endpoint: endpoint.clone(), reason: e.to_string() })?;
        let host = match (url.host_str(), url.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => h.to_string(),
            (None, _) => return Err(EcrError::Unreachable { endpoint: endpoint.clone(), reason: "no host".into() }),
        };
        let body = b"{}";
        let amz_date = amz_date(SystemTime::now());
        let headers = [("content-type", CONTENT_TYPE), ("host", host.as_str()), ("x-amz-date", amz_date.as_str()), ("x-amz-target", TARGET)];
        let authorization = sign(&Signing { method: "POST", path: "/", headers: &headers, body, key_id: &self.access_key_id, secret: &self.secret_access_key, region: &self.region, service: "ecr" });

        crate::install_tls_provider();
        let mut client = reqwest::Client::builder().timeout(DEADLINE).connect_timeout(DEADLINE).redirect(reqwest::redirect::Policy::none());
        if let Some(proxy) = proxy {
            client = client.proxy(reqwest::Proxy::all(proxy).map_err(unreachable)?);
        }
        let answer = client
            .build()
            .map_err(unreachable)?
            .post(url)
            .header("content-type", CONTENT_TYPE)
            .header("x-amz-date", &amz_date)
            .header("x-amz-target", TARGET)
            .header("authorization", authorization)
            .body(body.to_vec())
            .send()
            .await
            .map_err(unreachable)?;
        let status = answer.status().as_u16();
        let bytes = answer.bytes().await.map_err(unreachable)?;
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        if status != 200 {
            let text = |k: &str| json.get(k).and_then(|v| v.as_str()).map(str::to_string);
            let kind = text("__type").map(|t| t.rsplit('#').next().unwrap_or(&t).to_string());
            let message = match (kind, text("message").or_else(|| text("Message"))) {
                (Some(k), Some(m)) => format!("{k}: {m}"),
                (k, m) => k.or(m).unwrap_or_else(|| String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned()),
            };
            return Err(EcrError::Refused { status, message });
        }
        token_login(&json)
    }
}

/// `AWS:<password>` out of GetAuthorizationToken's answer.
fn token_login(answer: &serde_json::Value) -> Result<(String, String), EcrError> {
    use base64::Engine;
    let token = answer
        .pointer("/authorizationData/0/authorizationToken")
        .and_then(|t| t.as_str())
        .ok_or_else(|| EcrError::BadAnswer("no authorizationData[0].authorizationToken".into()))?;
    let decoded = base64::engine::general_purpose::STANDARD.decode(token).map_err(|e| EcrError::BadAnswer(format!("the token is not base64: {e}")))?;
    let text = String::from_utf8(decoded).map_err(|_| EcrError::BadAnswer("the token is not text".into()))?;
    let (user, password) = text.split_once(':').ok_or_else(|| EcrError::BadAnswer("the token is not USER:PASSWORD".into()))?;
    Ok((user.to_string(), password.to_string()))
}

/// SigV4's timestamp, `YYYYMMDD'T'HHMMSS'Z'` in UTC.
fn amz_date(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string().replace(['-', ':'], "")
}

/// One request to sign: headers lowercase, sorted by name, values trimmed.
struct Signing<'a> {
    method: &'a str,
    path: &'a str,
    headers: &'a [(&'a str, &'a str)],
    body: &'a [u8],
    key_id: &'a str,
    secret: &'a str,
    region: &'a str,
    service: &'a str,
}

fn hmac(key: &[u8], data: &str) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(data.as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// The `Authorization` header for a request with no query string and a path that needs
/// no percent-encoding. The date comes from its `x-amz-date` header.
fn sign(r: &Signing) -> String {
    // The canonical URI is the path as given: right only where encoding changes nothing.
    assert!(r.path.bytes().all(|b| b.is_ascii_alphanumeric() || b"/-_.~".contains(&b)), "a path SigV4 would encode: {}", r.path);
    let amz_date = r.headers.iter().find(|(k, _)| *k == "x-amz-date").map(|(_, v)| *v).unwrap_or_default();
    let day = &amz_date[..amz_date.len().min(8)];
    let canonical_headers: String = r.headers.iter().map(|(k, v)| format!("{k}:{}\n", v.trim())).collect();
    let signed_headers = r.headers.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(";");
    let canonical = format!("{}\n{}\n\n{canonical_headers}\n{signed_headers}\n{}", r.method, r.path, hex::encode(Sha256::digest(r.body)));
    let scope = format!("{day}/{}/{}/aws4_request", r.region, r.service);
    let to_sign = format!("AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}", hex::encode(Sha256::digest(canonical.as_bytes())));
    let key = [day, r.region, r.service, "aws4_request"].iter().fold(format!("AWS4{}", r.secret).into_bytes(), |key, part| hmac(&key, part));
    let signature = hex::encode(hmac(&key, &to_sign));
    format!("AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed_headers}, Signature={signature}", r.key_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "AKIDEXAMPLE";
    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";

    /// AWS's SigV4 test suite, `post-vanilla`.
    #[test]
    fn signs_as_aws_test_suite_says() {
        let headers = [("host", "example.amazonaws.com"), ("x-amz-date", "20150830T123600Z")];
        let r = Signing { method: "POST", path: "/", headers: &headers, body: b"", key_id: KEY, secret: SECRET, region: "us-east-1", service: "service" };
        assert_eq!(
            sign(&r),
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date, Signature=5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"
        );
    }

    /// curl's `--aws-sigv4` (its own implementation) signs the ECR call as hutch does.
    #[test]
    fn signs_the_ecr_call_as_curl_does() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let seen = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            conn.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).expect("read") == 1 {
                head.push(byte[0]);
            }
            let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            String::from_utf8(head).expect("utf-8")
        });
        let date = "20261204T030000Z";
        let host = format!("127.0.0.1:{port}");
        let curl = std::process::Command::new("curl")
            .args(["-sS", "--max-time", "10", "--aws-sigv4", "aws:amz:us-east-1:ecr", "--user", &format!("{KEY}:{SECRET}")])
            .args(["-H", &format!("Content-Type: {CONTENT_TYPE}"), "-H", &format!("X-Amz-Date: {date}"), "-H", &format!("X-Amz-Target: {TARGET}")])
            .args(["--data-binary", "{}", &format!("http://{host}/")])
            .output()
            .expect("curl is installed");
        assert!(curl.status.success(), "{}", String::from_utf8_lossy(&curl.stderr));
        let head = seen.join().expect("listener");
        let theirs = head.lines().find_map(|l| l.strip_prefix("Authorization: ")).expect("curl signed the request").trim().to_string();
        let headers = [("content-type", CONTENT_TYPE), ("host", host.as_str()), ("x-amz-date", date), ("x-amz-target", TARGET)];
        let ours = sign(&Signing { method: "POST", path: "/", headers: &headers, body: b"{}", key_id: KEY, secret: SECRET, region: "us-east-1", service: "ecr" });
        assert_eq!(ours, theirs, "{head}");
    }

    #[test]
    fn the_token_is_a_user_and_password() {
        let answer = serde_json::json!({"authorizationData": [{"authorizationToken": "QVdTOnNlY3JldDpwYXJ0", "proxyEndpoint": "https://1.dkr.ecr.us-east-1.amazonaws.com"}]});
        assert_eq!(token_login(&answer).expect("token"), ("AWS".into(), "secret:part".into()));
        assert!(matches!(token_login(&serde_json::json!({})), Err(EcrError::BadAnswer(_))));
        assert_eq!(amz_date(SystemTime::UNIX_EPOCH + Duration::from_secs(1_440_938_160)), "20150830T123600Z");
    }

    #[tokio::test]
    async fn a_bad_region_or_key_is_refused_before_any_call() {
        let login = |region: &str, key: &str| AwsLogin { access_key_id: key.into(), secret_access_key: SECRET.into(), region: region.into(), endpoint: Some("http://127.0.0.1:9/".into()) };
        for region in ["", "US-EAST-1", "evil.example.com/x", "us-east-1#", "1abc"] {
            assert!(matches!(login(region, KEY).login(None).await, Err(EcrError::BadRegion(_))), "{region}");
        }
        for key in ["", "akid-lower-case0", "AKID\r\nX-Evil: 1AAAAAAA"] {
            assert!(matches!(login("us-east-1", key).login(None).await, Err(EcrError::MissingKey)), "{key:?}");
        }
    }

    #[test]
    fn the_token_goes_only_to_the_regions_ecr() {
        let login = AwsLogin { access_key_id: KEY.into(), secret_access_key: SECRET.into(), region: "eu-west-1".into(), endpoint: None };
        login.check_registry("123456789012.dkr.ecr.eu-west-1.amazonaws.com").expect("its ECR");
        for host in ["123456789012.dkr.ecr.us-east-1.amazonaws.com", "evil.example.com", ".dkr.ecr.eu-west-1.amazonaws.com", "x.dkr.ecr.eu-west-1.amazonaws.com.evil.example"] {
            assert!(matches!(login.check_registry(host), Err(EcrError::NotEcr { .. })), "{host}");
        }
        let china = AwsLogin { region: "cn-north-1".into(), ..login };
        china.check_registry("123456789012.dkr.ecr.cn-north-1.amazonaws.com.cn").expect("China's domain");
        assert_eq!(china.endpoint(), "https://api.ecr.cn-north-1.amazonaws.com.cn/");
    }
}
