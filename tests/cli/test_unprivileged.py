"""`hutch run` for a user who is not root: the template is built without root
(mmdebstrap in a user namespace, the image written in one of the same shape), and the
guest still gets root-owned system files, setuid bits and its own user. Without root
there is no jail (docs/SECURITY.md): QEMU runs as that user."""

import os
import pwd
import shutil
import subprocess
from pathlib import Path

from conftest import HUTCH, ROOT

USER = "hutch-unpriv"


def ensure_user() -> Path:
    try:
        home = Path(pwd.getpwnam(USER).pw_dir)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", USER], check=True)
        home = Path(pwd.getpwnam(USER).pw_dir)
    for table, flag in (("/etc/subuid", "--add-subuids"), ("/etc/subgid", "--add-subgids")):
        lines = open(table).read().splitlines() if os.path.exists(table) else []
        if not any(line.startswith(f"{USER}:") for line in lines):
            subprocess.run(["usermod", flag, "300000-365535", USER], check=True)
    if subprocess.run(["getent", "group", "kvm"], capture_output=True).returncode == 0:
        subprocess.run(["usermod", "--append", "--groups", "kvm", USER], check=True)
    return home


def test_hutch_run_builds_and_boots_without_root():
    home = ensure_user()
    # The user's own copy: the checkout may sit where only root can read.
    bin_dir = home / "bin"
    bin_dir.mkdir(exist_ok=True)
    agent = ROOT / "target" / "x86_64-unknown-linux-musl" / "agent" / "hutch-agent"
    for src, name in ((HUTCH, "hutch"), (agent, "hutch-agent")):
        shutil.copy2(src, bin_dir / name)
    user = pwd.getpwnam(USER)
    for p in (bin_dir, bin_dir / "hutch", bin_dir / "hutch-agent"):
        os.chown(p, user.pw_uid, user.pw_gid)
    script = "id -un; stat -c '%u %a' /usr/bin/sudo /etc/shadow; sudo id -u"
    cmd = f"HUTCH_HOME={home}/hutch-home {bin_dir}/hutch run -- sh -c \"{script}\""
    r = subprocess.run(["su", USER, "-c", cmd], capture_output=True, text=True, timeout=1500, cwd=home)
    assert r.returncode == 0, r.stderr[-3000:]
    # The guest's own user, root-owned setuid sudo (mode 4755) and shadow (640), and sudo works.
    assert r.stdout == "user\n0 4755\n0 640\n0\n", (r.stdout, r.stderr[-2000:])
    leftovers = list((home / "hutch-home" / "tmp").iterdir()) + list((home / "hutch-home" / "sandboxes").iterdir())
    assert leftovers == [], leftovers
