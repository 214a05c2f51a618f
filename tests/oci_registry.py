"""Images on Debian's docker-registry, for the template tests: a registry on a free
loopback port, OCI images pushed through the distribution API, and tar layers made
here. Nothing leaves the machine."""

import contextlib
import gzip
import hashlib
import io
import json
import socket
import subprocess
import tarfile
from pathlib import Path

import httpx
from conftest import free_port, wait_until

BUSYBOX = Path("/bin/busybox")
APPLETS = ["sh", "echo", "cat", "id", "ls", "test", "sleep", "true"]


@contextlib.contextmanager
def docker_registry(root: Path):
    """Debian's docker-registry on a free loopback port, its storage under `root`."""
    addr = f"127.0.0.1:{free_port()}"
    (root / "config.yml").write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\nhttp:\n  addr: {addr}\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")], stdout=subprocess.DEVNULL,
                            stderr=open(root / "registry.log", "w"))

    def listening():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", int(addr.split(":")[1]))) == 0

    try:
        wait_until(listening, f"docker-registry to listen on {addr}", timeout=30)
        yield addr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def push(addr: str, repo: str, tag: str, layers: list[bytes], config: dict) -> None:
    """An OCI image through the distribution API (monolithic uploads)."""
    def blob(data: bytes, media_type: str) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        start = httpx.post(f"http://{addr}/v2/{repo}/blobs/uploads/")
        assert start.status_code == 202, start.text
        location = start.headers["Location"]
        url = location if location.startswith("http") else f"http://{addr}{location}"
        # The upload's own query (its state) stays; the digest is added to it.
        url += ("&" if "?" in url else "?") + "digest=" + digest
        put = httpx.put(url, content=data, headers={"Content-Type": "application/octet-stream"})
        assert put.status_code == 201, put.text
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
        "layers": [blob(l, "application/vnd.oci.image.layer.v1.tar+gzip") for l in layers],
    }
    r = httpx.put(f"http://{addr}/v2/{repo}/manifests/{tag}", content=json.dumps(manifest).encode(),
                  headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert r.status_code == 201, r.text


def layer(build) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        build(tar)
    return gzip.compress(buf.getvalue())


def add_dir(tar, name, mode=0o755, owner=0):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, owner, owner
    tar.addfile(info)


def add_file(tar, name, data: bytes, mode=0o644, owner=0):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uid, info.gid = len(data), mode, owner, owner
    tar.addfile(info, io.BytesIO(data))


def busybox_image(applets: list[str] = APPLETS) -> list[bytes]:
    def base(tar):
        for d in ("bin", "etc", "root", "srv"):
            add_dir(tar, d)
        add_dir(tar, "tmp", 0o1777)
        add_file(tar, "bin/busybox", BUSYBOX.read_bytes(), 0o755)
        for applet in applets:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        add_file(tar, "srv/gone", b"deleted by the next layer\n")

    def app(tar):
        add_file(tar, "srv/.wh.gone", b"")
        add_file(tar, "srv/hello", b"hello from an OCI layer\n")

    return [layer(base), layer(app)]


CONFIG = {"architecture": "amd64", "os": "linux", "config": {"Env": ["GREETING=hi"], "WorkingDir": "/srv", "User": "1000"},
          "rootfs": {"type": "layers", "diff_ids": []}}
