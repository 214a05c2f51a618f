//! Doing filesystem work with a guest user's permissions. The agent runs as root, so it
//! switches a thread's filesystem credentials (fsuid, fsgid, supplementary groups) to
//! the user's before touching their paths: the kernel then enforces the same access
//! rules as for the user's own processes, and what is created belongs to them.
//!
//! The raw syscalls change only the calling thread (libc's wrappers would change every
//! thread of the agent), and the thread is used for one operation and then ends.

use crate::process::user::GuestUser;

fn switch(user: &GuestUser) -> std::io::Result<()> {
    let groups: Vec<libc::gid_t> = user.groups.clone();
    // SAFETY: raw syscalls on this thread only; `groups` outlives the setgroups call.
    unsafe {
        if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        libc::syscall(libc::SYS_setfsgid, user.gid);
        libc::syscall(libc::SYS_setfsuid, user.uid);
        // setfs*id return the previous id, not an error: read back to verify.
        if libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32 != user.uid {
            return Err(std::io::Error::other("cannot switch filesystem credentials"));
        }
    }
    Ok(())
}

/// Runs `f` on a fresh thread with `user`'s filesystem permissions.
pub async fn as_user<T, F>(user: &GuestUser, f: F) -> std::io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    if user.uid == 0 {
        return tokio::task::spawn_blocking(f).await.map_err(std::io::Error::other);
    }
    let user = user.clone();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name("fs-as-user".into()).spawn(move || {
        let result = switch(&user).map(|()| f());
        let _ = tx.send(result);
    })?;
    rx.await.map_err(std::io::Error::other)?
}
