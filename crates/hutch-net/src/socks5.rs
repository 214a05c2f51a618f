//! The client half of SOCKS5 (RFC 1928) with username and password (RFC 1929), for
//! E2B's `network.egressProxy`: after the policy allows a guest's TCP connection, the
//! host opens it through the operator's or tenant's proxy instead of directly.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A sandbox's egress proxy (E2B's `network.egressProxy`). The password is kept in the
/// sandbox's record, which only hutch's user reads; no API view shows it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressProxy {
    /// A host name or IPv4 address, resolved again at every dial.
    pub host: String,
    pub port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
}

impl std::fmt::Debug for EgressProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxy").field("host", &self.host).field("port", &self.port).field("username", &self.username).finish_non_exhaustive()
    }
}

impl EgressProxy {
    pub fn login(&self) -> Option<(&str, &str)> {
        self.username.as_deref().map(|u| (u, self.password.as_deref().unwrap_or("")))
    }
}

const VERSION: u8 = 5;
const NO_AUTH: u8 = 0x00;
const USER_PASS: u8 = 0x02;
const NONE_ACCEPTABLE: u8 = 0xff;
const CONNECT: u8 = 0x01;
const ATYP_V4: u8 = 0x01;
const ATYP_NAME: u8 = 0x03;
const ATYP_V6: u8 = 0x04;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Socks5Error {
    #[error("the proxy does not speak SOCKS5 (it answered version {0})")]
    NotSocks5(u8),
    #[error("the proxy wants credentials; give egressProxy a username and password")]
    WantsCredentials,
    #[error("the proxy accepts none of the ways hutch offered to log in")]
    NoMethod,
    #[error("the proxy refused the username and password")]
    Refused,
    #[error("the proxy could not connect: {0}")]
    Connect(&'static str),
    #[error("the proxy's answer is malformed")]
    Malformed,
    #[error("talking to the proxy failed: {0}")]
    Io(String),
}

impl From<std::io::Error> for Socks5Error {
    fn from(e: std::io::Error) -> Self {
        Socks5Error::Io(e.to_string())
    }
}

/// Where the proxy is to connect: a name the guest resolved (the proxy resolves it
/// again, so it reaches the host the policy allowed by name), or an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Name(String, u16),
    Addr(std::net::SocketAddrV4),
}

/// Asks the proxy at the other end of `stream` to connect to `target`, logging in with
/// `login` (username, password) when given. On success `stream` carries the
/// connection from the next byte.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, target: &Target, login: Option<(&str, &str)>) -> Result<(), Socks5Error> {
    let greeting: &[u8] = if login.is_some() { &[VERSION, 2, NO_AUTH, USER_PASS] } else { &[VERSION, 1, NO_AUTH] };
    stream.write_all(greeting).await?;
    let mut choice = [0u8; 2];
    stream.read_exact(&mut choice).await?;
    if choice[0] != VERSION {
        return Err(Socks5Error::NotSocks5(choice[0]));
    }
    match (choice[1], login) {
        (NO_AUTH, _) => {}
        (USER_PASS, Some((user, pass))) => log_in(stream, user, pass).await?,
        (USER_PASS, None) => return Err(Socks5Error::WantsCredentials),
        (NONE_ACCEPTABLE, None) => return Err(Socks5Error::WantsCredentials),
        _ => return Err(Socks5Error::NoMethod),
    }
    let mut request = vec![VERSION, CONNECT, 0];
    let port = match target {
        Target::Name(name, port) => {
            let name = name.as_bytes();
            let len = u8::try_from(name.len()).map_err(|_| Socks5Error::Malformed)?;
            request.extend([ATYP_NAME, len]);
            request.extend_from_slice(name);
            *port
        }
        Target::Addr(addr) => {
            request.push(ATYP_V4);
            request.extend(addr.ip().octets());
            addr.port()
        }
    };
    request.extend(port.to_be_bytes());
    stream.write_all(&request).await?;
    let mut head = [0u8; 4];
    stream.read_exact(&mut head).await?;
    if head[0] != VERSION {
        return Err(Socks5Error::NotSocks5(head[0]));
    }
    if head[1] != 0 {
        return Err(Socks5Error::Connect(reply_text(head[1])));
    }
    // The address the proxy bound, which hutch does not need, then the port.
    let rest = match head[3] {
        ATYP_V4 => 4 + 2,
        ATYP_V6 => 16 + 2,
        ATYP_NAME => usize::from(stream.read_u8().await?) + 2,
        _ => return Err(Socks5Error::Malformed),
    };
    let mut bound = vec![0u8; rest];
    stream.read_exact(&mut bound).await?;
    Ok(())
}

async fn log_in<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, user: &str, pass: &str) -> Result<(), Socks5Error> {
    let (Ok(ulen), Ok(plen)) = (u8::try_from(user.len()), u8::try_from(pass.len())) else { return Err(Socks5Error::Refused) };
    let mut request = zeroize::Zeroizing::new(Vec::with_capacity(3 + user.len() + pass.len()));
    request.extend([1, ulen]);
    request.extend_from_slice(user.as_bytes());
    request.push(plen);
    request.extend_from_slice(pass.as_bytes());
    stream.write_all(&request).await?;
    let mut status = [0u8; 2];
    stream.read_exact(&mut status).await?;
    if status[0] != 1 {
        return Err(Socks5Error::Malformed);
    }
    if status[1] != 0 {
        return Err(Socks5Error::Refused);
    }
    Ok(())
}

fn reply_text(code: u8) -> &'static str {
    match code {
        1 => "general failure",
        2 => "its rules do not allow the connection",
        3 => "network unreachable",
        4 => "host unreachable",
        5 => "connection refused",
        6 => "TTL expired",
        7 => "command not supported",
        8 => "address type not supported",
        _ => "an unknown error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proxy's side of one exchange, scripted: what it expects, then what it answers.
    async fn proxy(script: Vec<(Vec<u8>, Vec<u8>)>) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<Vec<Vec<u8>>>) {
        let (client, mut server) = tokio::io::duplex(4096);
        let task = tokio::spawn(async move {
            let mut seen = Vec::new();
            for (expect, answer) in script {
                let mut got = vec![0u8; expect.len()];
                if server.read_exact(&mut got).await.is_err() {
                    break;
                }
                seen.push(got);
                if server.write_all(&answer).await.is_err() {
                    break;
                }
            }
            seen
        });
        (client, task)
    }

    #[tokio::test]
    async fn a_login_then_a_connect_by_name() {
        let connect_req = [&[5, 1, 0, 3, 9][..], b"api.x.com", &443u16.to_be_bytes()].concat();
        let (mut client, task) = proxy(vec![
            (vec![5, 2, 0, 2], vec![5, 2]),
            ([&[1, 1][..], b"u", &[2], b"pw"].concat(), vec![1, 0]),
            (connect_req.clone(), vec![5, 0, 0, 1, 10, 0, 0, 1, 0, 80]),
        ])
        .await;
        connect(&mut client, &Target::Name("api.x.com".into(), 443), Some(("u", "pw"))).await.expect("connected");
        assert_eq!(task.await.expect("proxy").last(), Some(&connect_req));
    }

    #[tokio::test]
    async fn refusals_say_which() {
        let addr = Target::Addr("93.184.216.34:80".parse().expect("addr"));
        let (mut c, _t) = proxy(vec![(vec![5, 1, 0], vec![5, 0xff])]).await;
        assert_eq!(connect(&mut c, &addr, None).await, Err(Socks5Error::WantsCredentials));
        let (mut c, _t) = proxy(vec![(vec![5, 2, 0, 2], vec![5, 2]), (vec![1, 1, b'u', 1, b'p'], vec![1, 1])]).await;
        assert_eq!(connect(&mut c, &addr, Some(("u", "p"))).await, Err(Socks5Error::Refused));
        let (mut c, _t) = proxy(vec![(vec![5, 1, 0], vec![5, 0]), (vec![5, 1, 0, 1, 93, 184, 216, 34, 0, 80], vec![5, 5, 0, 1])]).await;
        assert_eq!(connect(&mut c, &addr, None).await, Err(Socks5Error::Connect("connection refused")));
        let (mut c, _t) = proxy(vec![(vec![5, 1, 0], b"HTTP/1.1 400".to_vec())]).await;
        assert!(matches!(connect(&mut c, &addr, None).await, Err(Socks5Error::NotSocks5(b'H'))));
    }
}
