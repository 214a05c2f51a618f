//! Guest users from /etc/passwd and /etc/group, parsed directly so no NSS is needed and
//! any Linux root filesystem works.

use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
    /// Supplementary groups, including the primary one.
    pub groups: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
#[error("user '{0}' does not exist in the sandbox")]
pub struct UnknownUser(pub String);

impl GuestUser {
    pub fn root() -> Self {
        GuestUser {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
            shell: "/bin/sh".into(),
            groups: vec![0],
        }
    }

    pub fn lookup(name: &str) -> Result<Self, UnknownUser> {
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        let group = std::fs::read_to_string("/etc/group").unwrap_or_default();
        let account_name = account(&passwd, name);
        match parse(&passwd, &group, account_name) {
            Some(u) => Ok(u),
            None if account_name == "root" => Ok(Self::root()),
            None => numeric(name).ok_or_else(|| UnknownUser(account_name.to_string())),
        }
    }
}

/// The account `name` means: an image's `User` may be a uid (`1000`) or `user:group`,
/// and the account is what counts.
fn account<'a>(passwd: &'a str, name: &'a str) -> &'a str {
    let name = name.split(':').next().unwrap_or(name);
    let by_uid = name.parse::<u32>().ok().and_then(|uid| passwd.lines().find(|l| l.split(':').nth(2) == Some(uid.to_string().as_str())));
    by_uid.and_then(|l| l.split(':').next()).unwrap_or(name)
}

/// A `uid[:gid]` with no account (an image's `USER 1001`, as Docker runs it): that uid,
/// the gid given or the same number, home `/`.
fn numeric(name: &str) -> Option<GuestUser> {
    let (uid, gid) = match name.split_once(':') {
        Some((u, g)) => (u.parse::<u32>().ok()?, g.parse::<u32>().ok()?),
        None => {
            let uid: u32 = name.parse().ok()?;
            (uid, uid)
        }
    };
    Some(GuestUser { name: uid.to_string(), uid, gid, home: "/".into(), shell: "/bin/sh".into(), groups: vec![gid] })
}

fn parse(passwd: &str, group: &str, name: &str) -> Option<GuestUser> {
    let line = passwd.lines().find(|l| l.split(':').next() == Some(name))?;
    let f: Vec<&str> = line.split(':').collect();
    if f.len() < 7 {
        return None;
    }
    let uid = f[2].parse().ok()?;
    let gid = f[3].parse().ok()?;
    let mut groups = vec![gid];
    for g in group.lines() {
        let gf: Vec<&str> = g.split(':').collect();
        if gf.len() >= 4 && gf[3].split(',').any(|m| m == name) {
            if let Ok(id) = gf[2].parse::<u32>() {
                if !groups.contains(&id) {
                    groups.push(id);
                }
            }
        }
    }
    let shell = if f[6].is_empty() { "/bin/sh" } else { f[6] };
    Some(GuestUser { name: name.into(), uid, gid, home: f[5].into(), shell: shell.into(), groups })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_passwd_and_groups() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n";
        let group = "root:x:0:\nsudo:x:27:user\nuser:x:1000:\n";
        let u = parse(passwd, group, "user").expect("user");
        assert_eq!((u.uid, u.gid), (1000, 1000));
        assert_eq!(u.home, PathBuf::from("/home/user"));
        assert_eq!(u.groups, vec![1000, 27]);
        assert!(parse(passwd, group, "nobody").is_none());
    }

    #[test]
    fn an_image_user_may_be_a_uid_or_user_and_group() {
        let passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n";
        assert_eq!(account(passwd, "1000"), "app");
        assert_eq!(account(passwd, "0:0"), "root");
        assert_eq!(account(passwd, "app:staff"), "app");
        assert_eq!(account(passwd, "4242"), "4242", "an unknown uid stays as it is");
        let bare = numeric("4242:50").expect("a bare uid:gid");
        assert_eq!((bare.uid, bare.gid, bare.home.as_path()), (4242, 50, std::path::Path::new("/")));
        assert_eq!(numeric("1001").map(|u| u.gid), Some(1001));
        assert!(numeric("nobody-here").is_none());
    }
}
