"""`hutch template build --from-image`: images this test pushes to Debian's
docker-registry on loopback become templates, and `hutch run --template` boots them.
The image is busybox alone (static, no bash, no libc): the agent comes from the
initramfs, so any Linux userland boots. Nothing leaves the machine."""

import gzip
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, HUTCH, Server, free_port, launch, new_home, shared_home, stop, wait_until
from oci_registry import BUSYBOX, CONFIG, add_dir, add_file, busybox_image, docker_registry, layer, push


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with docker_registry(tmp_path_factory.mktemp("registry")) as addr:
        yield addr


@pytest.fixture
def home():
    """A home of its own (templates built here stay here), with the shared kernel and initramfs."""
    home = Path(tempfile.mkdtemp(prefix="hutch-oci-", dir="/tmp"))
    for sub in ("kernel", "initramfs"):
        (home / sub).symlink_to(shared_home() / sub)
    yield home
    shutil.rmtree(home, ignore_errors=True)


def hutch(home: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HUTCH_HOME=str(home))
    return subprocess.run([str(HUTCH), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_a_busybox_image_becomes_a_template_that_boots(registry, home):
    assert BUSYBOX.exists(), "busybox-static is not installed (scripts/test.sh installs it)"
    push(registry, "bb", "1", busybox_image(), CONFIG)
    built = hutch(home, "template", "build", "-t", "bbtest", "--from-image", f"{registry}/bb:1", "--insecure-registry", registry)
    assert built.returncode == 0, built.stderr
    assert "2 layer(s) downloaded" in built.stderr, built.stderr
    listed = hutch(home, "template", "ls")
    assert "bbtest" in listed.stdout and f"{registry}/bb:1" in listed.stdout, listed.stdout
    ran = hutch(home, "run", "--template", "bbtest", "--", "/bin/sh", "-c",
                "cat /srv/hello; test -e /srv/gone || echo gone; id -u user; echo $0; echo $GREETING; pwd; id -u")
    assert ran.returncode == 0, ran.stderr
    # The layers merged (the whiteout removed /srv/gone), the default user was added, and
    # the image's Env, WorkingDir and User (uid 1000) are the sandbox's defaults.
    assert ran.stdout.splitlines() == ["hello from an OCI layer", "gone", "1000", "/bin/sh", "hi", "/srv", "1000"], ran.stdout
    # The same image again: every layer comes from the cache.
    again = hutch(home, "template", "build", "-t", "bbtest", "--from-image", f"{registry}/bb:1", "--insecure-registry", registry)
    assert again.returncode == 0 and "0 layer(s) downloaded" in again.stderr and "2 already cached" in again.stderr, again.stderr


# Reads an xattr and a device node's numbers: what an image's layers set must reach
# the booted guest's filesystem, not only the host's unpacked tree.
PROBE_C = r"""
#include <stdio.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
int main(int argc, char **argv) {
    char value[64] = {0};
    struct stat st;
    if (argc != 3 || getxattr(argv[1], "user.hutch", value, sizeof value - 1) < 0 || stat(argv[2], &st) != 0) {
        perror("probe");
        return 1;
    }
    printf("xattr=%s dev=%c%u,%u\n", value, S_ISCHR(st.st_mode) ? 'c' : '?', major(st.st_rdev), minor(st.st_rdev));
    return 0;
}
"""
MUSL_LOADER = "/lib/ld-musl-x86_64.so.1"


def test_an_alpine_style_image_runs_a_dynamic_musl_binary_and_keeps_xattrs_and_devices(registry, home, tmp_path):
    """Alpine's shape (busybox, a dynamically linked musl program, no passwd) boots; a
    file's xattr and a character device from the layers are there in the guest."""
    (tmp_path / "probe.c").write_text(PROBE_C)
    subprocess.run(["musl-gcc", "-O2", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")], check=True)
    probe = (tmp_path / "probe").read_bytes()
    assert MUSL_LOADER.encode() in probe, "musl-gcc made no dynamically linked program"

    def musl(tar):
        for d in ("lib", "usr", "usr/bin"):
            add_dir(tar, d)
        # musl's dynamic loader is its libc.
        add_file(tar, MUSL_LOADER.lstrip("/"), Path("/usr/lib/x86_64-linux-musl/libc.so").read_bytes(), 0o755)
        add_file(tar, "usr/bin/probe", probe, 0o755)
        marked = tarfile.TarInfo("srv/marked")
        marked.size, marked.mode, marked.pax_headers = 5, 0o644, {"SCHILY.xattr.user.hutch": "kept"}
        tar.addfile(marked, io.BytesIO(b"mark\n"))
        device = tarfile.TarInfo("srv/null2")
        device.type, device.mode, device.devmajor, device.devminor = tarfile.CHRTYPE, 0o666, 1, 3
        tar.addfile(device)

    push(registry, "musl", "1", busybox_image() + [layer(musl)], CONFIG)
    built = hutch(home, "template", "build", "-t", "musltest", "--from-image", f"{registry}/musl:1", "--insecure-registry", registry)
    assert built.returncode == 0, built.stderr
    ran = hutch(home, "run", "--template", "musltest", "--", "/usr/bin/probe", "/srv/marked", "/srv/null2")
    assert ran.returncode == 0 and ran.stdout == "xattr=kept dev=c1,3\n", (ran.stdout, ran.stderr)


def test_bad_builds_say_why_and_leave_no_template(registry, home):
    missing = hutch(home, "template", "build", "-t", "nope", "--from-image", f"{registry}/bb:missing", "--insecure-registry", registry)
    assert missing.returncode != 0 and "was not found in its registry" in missing.stderr, missing.stderr
    bad_name = hutch(home, "template", "build", "-t", "Bad Name", "--from-image", f"{registry}/bb:1", "--insecure-registry", registry)
    assert bad_name.returncode != 0 and "template names are" in bad_name.stderr, bad_name.stderr
    # A layer whose one file is larger than the template disk (its header says 5 GiB;
    # the check comes before any byte of it is read or written).
    huge = tarfile.TarInfo("big.bin")
    huge.size = 5 << 30
    push(registry, "huge", "1", busybox_image()[:1] + [gzip.compress(huge.tobuf(format=tarfile.GNU_FORMAT))], CONFIG)
    too_big = hutch(home, "template", "build", "-t", "nope", "--from-image", f"{registry}/huge:1", "--insecure-registry", registry)
    assert too_big.returncode != 0 and "would not fit the template disk" in too_big.stderr, too_big.stderr
    assert not (home / "templates" / "nope").exists()
    leftovers = list((home / "tmp").glob("template-image-*")) if (home / "tmp").exists() else []
    assert not leftovers, leftovers


DOCKERFILE = """\
FROM {registry}/bb:1
ARG WHO=world
ENV APP_HOME=/srv/app
WORKDIR $APP_HOME
COPY app.txt ./
COPY --chown=user conf/ /etc/myapp/
RUN echo "hello $WHO" > built.txt && cat app.txt
USER user
EXPOSE 8080
CMD ["sh", "-c", "sleep 1000"]
"""


def build_dockerfile(home: Path, ctx: Path, registry: str, *extra: str, name: str = "bbdocker") -> subprocess.CompletedProcess:
    return hutch(home, "template", "build", "-t", name, "--insecure-registry", registry, "--build-arg", "WHO=there", *extra, str(ctx))


def builder_lines(stderr: str) -> list[str]:
    return [l for l in stderr.splitlines() if "[builder " in l]


def test_a_dockerfile_builds_caches_and_rebuilds_from_the_changed_step(registry, home, tmp_path):
    push(registry, "bb", "1", busybox_image(), CONFIG)
    ctx = tmp_path / "ctx"
    (ctx / "conf").mkdir(parents=True)
    (ctx / "app.txt").write_text("app v1\n")
    (ctx / "conf" / "c.conf").write_text("answer=42\n")
    (ctx / "conf" / "skip.log").write_text("ignored\n")
    (ctx / ".dockerignore").write_text("**/*.log\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(registry=registry))

    built = build_dockerfile(home, ctx, registry)
    assert built.returncode == 0, built.stderr
    assert "Dockerfile:9:1: EXPOSE is ignored" in built.stderr, built.stderr
    assert "app v1" in built.stderr, "the RUN step's output is in the build log"
    # Only step 1 (ENV, before any step that writes) has nothing to do.
    assert [l.startswith("CACHED") for l in builder_lines(built.stderr)] == [True] + [False] * 6, built.stderr
    ran = hutch(home, "run", "--template", "bbdocker", "--", "sh", "-c",
                "cat app.txt built.txt /etc/myapp/c.conf; test -e /etc/myapp/skip.log || echo no-log; echo $APP_HOME; pwd; id -u; id -u -n")
    assert ran.returncode == 0, ran.stderr
    # COPY, RUN with the build argument, .dockerignore, ENV, WORKDIR and USER all hold.
    assert ran.stdout.splitlines() == ["app v1", "hello there", "answer=42", "no-log", "/srv/app", "/srv/app", "1000", "user"], ran.stdout

    # Unchanged: every step is CACHED and no VM runs.
    again = build_dockerfile(home, ctx, registry)
    assert again.returncode == 0, again.stderr
    lines = builder_lines(again.stderr)
    assert len(lines) == 7 and all(l.startswith("CACHED") for l in lines), again.stderr
    assert "4 step(s) cached, 0 run" in again.stdout, again.stdout  # the steps that left layers

    # Step 3 (COPY app.txt) changed: steps 1-2 stay cached, 3 and later run again. Built
    # under a tag, it is `bbdocker:edited`; `bbdocker` is still the first build.
    (ctx / "app.txt").write_text("app v2\n")
    edited = build_dockerfile(home, ctx, registry, name="bbdocker:edited")
    assert edited.returncode == 0, edited.stderr
    lines = builder_lines(edited.stderr)
    assert [l.startswith("CACHED") for l in lines] == [True, True, False, False, False, False, False], edited.stderr
    for reference, content in (("bbdocker:edited", "app v2\n"), ("bbdocker", "app v1\n")):
        ran = hutch(home, "run", "--template", reference, "--", "cat", "/srv/app/app.txt")
        assert ran.stdout == content, (reference, ran.stdout + ran.stderr)
    listed = hutch(home, "template", "ls").stdout.splitlines()
    assert [l.split()[0] for l in listed if l.startswith("bbdocker")] == ["bbdocker", "bbdocker:edited"], listed
    unknown = hutch(home, "run", "--template", "bbdocker:nope", "--", "true")
    assert unknown.returncode != 0 and "has no tag 'nope'; its tags: default, edited" in unknown.stderr, unknown.stderr
    # `rm NAME:TAG` removes the tag alone; its build, its snapshot named by the tag and
    # nothing else go with it.
    snapshots = home / "snapshots" / "templates"
    assert list(snapshots.glob("bbdocker@edited-*")), "running bbdocker:edited made its own memory snapshot"
    removed = hutch(home, "template", "rm", "bbdocker:edited")
    assert removed.returncode == 0 and "removed tag edited of template bbdocker" in removed.stdout, removed.stdout + removed.stderr
    assert not list(snapshots.glob("bbdocker@edited-*")), list(snapshots.iterdir())
    assert [l.split()[0] for l in hutch(home, "template", "ls").stdout.splitlines() if l.startswith("bbdocker")] == ["bbdocker"]
    assert "app v1" in hutch(home, "run", "--template", "bbdocker", "--", "cat", "/srv/app/app.txt").stdout

    # --no-cache runs every step again.
    forced = build_dockerfile(home, ctx, registry, "--no-cache")
    assert forced.returncode == 0 and not [l for l in builder_lines(forced.stderr) if l.startswith("CACHED")], forced.stderr
    assert "CACHED [base]" not in forced.stderr, forced.stderr


def test_bad_dockerfiles_say_where_and_leave_nothing(registry, home, tmp_path):
    push(registry, "bb", "1", busybox_image(), CONFIG)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    cases = {
        "FROM {r}/bb:1\nRUNN echo\n": "Dockerfile:2:1: unknown instruction",
        "FROM {r}/bb:1\nCOPY --from=x /a /b\n": "Dockerfile:2:6: COPY --from",
        "FROM {r}/bb:1 AS a\nFROM {r}/bb:1\n": "Dockerfile:2:1: multi-stage",
        "FROM {r}/bb:1\nCOPY nothere.txt /x\n": "Dockerfile:2:6: the COPY source 'nothere.txt' is not in the build context",
        "FROM {r}/bb:1\nADD https://example.invalid/x.tgz /x\n": "URLs are not supported",
    }
    for text, expected in cases.items():
        (ctx / "Dockerfile").write_text(text.format(r=registry))
        bad = hutch(home, "template", "build", "-t", "badone", "--insecure-registry", registry, str(ctx))
        assert bad.returncode != 0 and expected in bad.stderr, (text, bad.stderr)
    (ctx / "Dockerfile").write_text(f"FROM {registry}/bb:1\nRUN echo one-line-of-output && false\n")
    failed = hutch(home, "template", "build", "-t", "badone", "--insecure-registry", registry, str(ctx))
    assert failed.returncode != 0, failed.stderr
    assert "step 1/1 `RUN echo one-line-of-output && false` exited with 1" in failed.stderr, failed.stderr
    assert "one-line-of-output" in failed.stderr.split("exited with 1")[1], "the error quotes the step's last output"
    # No template, no builder VM, no scratch directory left.
    assert not (home / "templates" / "badone").exists()
    assert not any((home / "sandboxes").iterdir()) if (home / "sandboxes").exists() else True
    assert not any((home / "cache" / "build" / "tmp").iterdir())
    left = subprocess.run(["pgrep", "-f", f"{home}/sandboxes"], capture_output=True, text=True)
    assert left.stdout == "", "no QEMU of this home is left running"


SDK_TEMPLATES = ("sdktpl", "sdkbad", "sdkchild")


@pytest.fixture
def builds_server(registry, net_world, monkeypatch):
    """A hutch serve whose operator lets API builds pull from the test's loopback
    registry (`--insecure-registry`); the official SDK talks to it. Its templates are
    the shared home's, so the names these tests build are cleared before and after."""
    clear_sdk_templates()
    home = new_home("hutch-builds-")
    port = free_port()
    # A warm pool of sdkchild: a rebuild must replace its waiting sandbox.
    proc = launch(home, port, "--insecure-registry", registry, "--pool", "sdkchild=1", env_extra={"HUTCH_NET_TEST_MAP": str(net_world.map)})
    url = f"http://127.0.0.1:{port}"
    for var in ("E2B_API_URL", "E2B_SANDBOX_URL"):
        monkeypatch.setenv(var, url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    yield Server(url, home, proc)
    stop(proc)
    clear_sdk_templates()
    shutil.rmtree(home, ignore_errors=True)


def clear_sdk_templates():
    """The SDK tests' templates in the shared home, with their memory snapshots (and
    those snapshots' lock files): removed under the server's feet, the snapshots would
    outlive their images and keep the home's pruners from reading their chains."""
    snapshots = shared_home() / "snapshots" / "templates"
    for name in SDK_TEMPLATES:
        shutil.rmtree(shared_home() / "templates" / name, ignore_errors=True)
        for left in snapshots.glob(f"{name}-*"):
            shutil.rmtree(left, ignore_errors=True) if left.is_dir() else left.unlink(missing_ok=True)


def sdk_template(ctx, registry, variant=None):
    """The SDK test's template; a `variant` adds one last ENV step (every earlier step
    is the same, so a build of it reuses their layers)."""
    from e2b import Template
    t = (
        Template(file_context_path=str(ctx))
        .from_image(f"{registry}/bb:1")
        .set_envs({"GREETING": "from-sdk"})
        .copy("app.txt", "/home/user/app.txt")
        # E2B's own test's copy: a pattern's matches fill the directory (symlinks kept).
        .copy("folder/*", "/home/user/folder")
        .set_workdir("/home/user/work")
        .run_cmd("echo built-by-$(id -u) > made.txt")
        .run_cmd("echo root-step > /srv/root.txt", user="root")
        # The SDK runs commands with /bin/bash, which a busybox image lacks.
        .run_cmd("printf '#!/bin/sh\\nexec /bin/sh \"$@\"\\n' > /bin/bash && busybox chmod 755 /bin/bash", user="root")
        .set_user("user")
    )
    if variant:
        t = t.set_envs({"VARIANT": variant})
    return t.set_start_cmd("echo started > /tmp/started; sleep 100000", "test -e /tmp/started")


def test_the_official_sdk_builds_a_template_and_sandboxes_start_from_it(registry, builds_server, tmp_path):
    """E2B's `Template.build` unchanged against hutch serve: base from the loopback
    registry, COPY (uploaded through the file-hash handshake), ENV, WORKDIR, RUN, USER
    and a start command; then `Sandbox.create(name)` sees all of it."""
    from e2b import Sandbox, Template
    push(registry, "bb", "1", busybox_image(), CONFIG)
    ctx = tmp_path / "sdkctx"
    ctx.mkdir()
    (ctx / "app.txt").write_text("copied by the SDK\n")
    # E2B's folder for `copy("folder/*", "folder")`: a file, a relative symlink to it, an
    # absolute one (to this host's path, dangling in the guest) and a dangling one.
    folder = ctx / "folder"
    folder.mkdir()
    (folder / "test.txt").write_text("This is a test file.")
    (folder / "symlink.txt").symlink_to("test.txt")
    (folder / "symlink2.txt").symlink_to(folder / "test.txt")
    (folder / "symlink3.txt").symlink_to("12345test.txt")
    template = sdk_template(ctx, registry)
    logs = []
    info = Template.build(template, "sdktpl:v1", on_build_logs=lambda e: logs.append(str(e.message)))
    assert info.template_id == "sdktpl", info
    assert any("[builder" in l for l in logs), logs
    assert Template.exists("sdktpl")
    assert not Template.exists("no-such-template")
    sbx = Sandbox.create("sdktpl")
    try:
        r = sbx.commands.run("cat /home/user/app.txt made.txt /srv/root.txt /tmp/started; echo $GREETING; pwd; id -u -n")
        assert r.stdout.splitlines() == ["copied by the SDK", "built-by-1000", "root-step", "started", "from-sdk", "/home/user/work", "user"], r.stdout
        copied = sbx.commands.run("cd /home/user/folder && cat test.txt symlink.txt && echo && readlink symlink2.txt && readlink symlink3.txt")
        assert copied.stdout.splitlines() == ["This is a test file.This is a test file.", str(folder / "test.txt"), "12345test.txt"], copied.stdout
    finally:
        sbx.kill()
    # The template list and the template, parsed by the SDK's own generated models.
    from e2b.api.client.api.templates import get_templates, get_templates_template_id
    from e2b.api.client_sync import get_api_client
    from e2b.connection_config import ConnectionConfig
    client = get_api_client(ConnectionConfig(api_key=API_KEY, api_url=builds_server.url))
    listed = get_templates.sync_detailed(client=client)
    assert listed.status_code == 200 and listed.parsed is not None, listed.content
    mine = {t.template_id: t for t in listed.parsed}
    assert "sdktpl" in mine and not mine["sdktpl"].public and mine["sdktpl"].build_status == "ready", listed.content
    one = get_templates_template_id.sync_detailed("sdktpl", client=client)
    assert one.status_code == 200 and one.parsed is not None, one.content
    assert [str(b.build_id) for b in one.parsed.builds] == [mine["sdktpl"].build_id] and one.parsed.names == ["sdktpl"], one.content
    # One id per build: the one the build answered with is the one the list shows.
    assert mine["sdktpl"].build_id == info.build_id, (mine["sdktpl"].build_id, info)
    # The build's log, paged by the SDK's logs client: oldest first from a cursor, or
    # newest first.
    from e2b.api.client.api.templates import get_templates_template_id_builds_build_id_logs as build_logs
    from e2b.api.client.models.logs_direction import LogsDirection
    first = build_logs.sync_detailed("sdktpl", info.build_id, client=client, limit=2)
    assert first.status_code == 200 and len(first.parsed.logs) == 2, first.content
    # From a cursor just past the first entry: it is left out, later ones come.
    cursor = round(first.parsed.logs[0].timestamp.timestamp() * 1000) + 1
    later = build_logs.sync_detailed("sdktpl", info.build_id, client=client, cursor=cursor)
    assert later.parsed.logs and all(round(e.timestamp.timestamp() * 1000) >= cursor for e in later.parsed.logs), later.content
    assert first.parsed.logs[0].message not in [e.message for e in later.parsed.logs], later.content
    newest = build_logs.sync_detailed("sdktpl", info.build_id, client=client, direction=LogsDirection.BACKWARD, limit=1)
    assert "template sdktpl" in newest.parsed.logs[0].message and "ready" in newest.parsed.logs[0].message, newest.content
    from e2b.api.client.models.log_level import LogLevel
    errors = build_logs.sync_detailed("sdktpl", info.build_id, client=client, level=LogLevel.ERROR)
    assert errors.status_code == 200 and errors.parsed.logs == [], errors.content
    assert get_templates_template_id.sync_detailed("no-such-template", client=client).status_code == 404
    # A cold boot (no memory snapshot) runs the start command too, and waits for ready.
    cold_home = new_home("hutch-cold-")
    try:
        cold = hutch(cold_home, "run", "--cold", "--template", "sdktpl", "--", "cat", "/tmp/started")
        assert cold.returncode == 0 and cold.stdout == "started\n", (cold.stdout, cold.stderr)
    finally:
        shutil.rmtree(cold_home, ignore_errors=True)
    check_tags(Sandbox, Template, template, info, ctx, registry)
    check_from_template_and_skip_cache(Sandbox, Template, builds_server.url)
    # An unchanged rebuild reuses every layer.
    again = []
    Template.build(template, "sdktpl:v1", on_build_logs=lambda e: again.append(str(e.message)))
    steps = [l for l in again if "[builder" in l]
    assert steps and all("CACHED" in l for l in steps), again
    with builds_server.api() as api:
        # sdkchild's build cache layers stack on sdktpl and go with it.
        layers = builds_server.home / "cache" / "build" / "layers"
        stacked = len(list(layers.iterdir()))
        gone = api.delete("/templates/sdktpl")
        assert gone.status_code == 204, gone.text
        assert len(list(layers.iterdir())) < stacked, "no build cache layer went with the template"
        assert api.get("/templates/aliases/sdktpl").status_code == 404
    # The server had it prepared: a create now hears it is gone (a 400), not a failed boot.
    with pytest.raises(Exception) as e:
        Sandbox.create("sdktpl")
    assert "unknown template 'sdktpl'" in str(e.value), str(e.value)


def check_from_template_and_skip_cache(Sandbox, Template, url):
    """A template built on another (`from_template` of sdktpl, whose deletion later
    takes the build cache layers stacked on it along): it has the parent's files; built
    again, the step before `skip_cache()` is CACHED and the one after runs again. The
    server pools sdkchild: once rebuilt, a create gets the new build, not the sandbox
    that waited with the old one."""
    child = Template().from_template("sdktpl").run_cmd("echo one > /home/user/work/one").skip_cache().run_cmd("cat /proc/sys/kernel/random/uuid > /home/user/work/two")
    stamps = []
    for attempt in ("first", "again"):
        logs = []
        Template.build(child, "sdkchild", on_build_logs=lambda e: logs.append(str(e.message)))
        steps = [l for l in logs if "[builder" in l]
        assert len(steps) == 2, logs
        cached = ["CACHED" in l for l in steps]
        assert cached == ([False, False] if attempt == "first" else [True, False]), (attempt, steps)
        if attempt == "first":
            # The pool fills with the first build and refills after handing it out;
            # full again, it holds a sandbox of the first build when the rebuild ends.
            for _ in range(2):
                wait_pool(url, "sdkchild")
                stamps.append(child_files(Sandbox)[2])
            wait_pool(url, "sdkchild")
        else:
            stamps.append(child_files(Sandbox)[2])
    assert stamps[0] == stamps[1] != stamps[2], f"a sandbox of the old build was handed out after the rebuild: {stamps}"


def wait_pool(url, template):
    def ready():
        return httpx.get(url + "/status", headers={"X-API-Key": API_KEY}).json()["pools"][template]["ready"] >= 1
    wait_until(ready, f"the {template} pool to fill", timeout=180, interval=0.5)


def child_files(Sandbox):
    """`[the parent's app.txt, one, two]` of a new sdkchild sandbox."""
    sbx = Sandbox.create("sdkchild")
    try:
        lines = sbx.commands.run("cat /home/user/app.txt /home/user/work/one /home/user/work/two").stdout.splitlines()
        assert lines[:2] == ["copied by the SDK", "one"] and len(lines) == 3, lines
        return lines
    finally:
        sbx.kill()


def variant_of(Sandbox, reference):
    """`([VARIANT], vCPUs, MemTotal in MiB, MiB free on /)` of a sandbox of `reference`."""
    sbx = Sandbox.create(reference)
    try:
        out = sbx.commands.run('echo "[$VARIANT]" $(busybox nproc) $(( $(busybox awk \'/MemTotal/ {print $2}\' /proc/meminfo) / 1024 ))'
                               ' $(busybox df -m / | busybox awk \'NR == 2 {print $4}\')').stdout.split()
        return out[0], int(out[1]), int(out[2]), int(out[3])
    finally:
        sbx.kill()


def check_tags(Sandbox, Template, template, v1, ctx, registry):
    """E2B's tags through the SDK: a build tagged v2 leaves the template's default
    build alone, `name:tag` starts the build its tag names (with the vCPUs and memory
    it was built for), tags move (`default` too) and go; a bad removal says why and
    removes nothing."""
    from e2b.exceptions import BuildException, TemplateException
    with pytest.raises(BuildException) as e:
        Template.build(sdk_template(ctx, registry, "two"), "sdktpl:v2", cpu_count=65)
    assert "cpuCount 65 is not allowed" in str(e.value), str(e.value)
    v2 = Template.build(sdk_template(ctx, registry, "two"), "sdktpl:v2", cpu_count=2, memory_mb=768, min_free_disk_mb=5000)
    assert v2.build_id != v1.build_id, (v1, v2)
    tags = {t.tag: t.build_id for t in Template.get_tags("sdktpl")}
    assert tags == {"default": v1.build_id, "v1": v1.build_id, "v2": v2.build_id}, tags
    two = variant_of(Sandbox, "sdktpl:v2")
    # The guest's MemTotal is its RAM less what the kernel keeps for itself. The disk
    # grew past the 4 GiB every template has, to leave 5000 MiB free.
    assert two[:2] == ("[two]", 2) and 640 < two[2] <= 768 and two[3] >= 5000, two
    one = variant_of(Sandbox, "sdktpl")
    assert one[:2] == ("[]", 1) and one[3] < 4096, one
    assigned = Template.assign_tags("sdktpl:v2", ["Prod", "default"])
    assert assigned.build_id == v2.build_id and sorted(assigned.tags) == ["default", "prod"], assigned
    assert variant_of(Sandbox, "sdktpl")[:3] == two[:3]
    Template.remove_tags("sdktpl", "prod")
    for tag, why in (("default", "cannot be removed"), ("nope", "has no tag 'nope'")):
        with pytest.raises(TemplateException) as e:
            Template.remove_tags("sdktpl", tag)
        assert why in str(e.value), str(e.value)
    with pytest.raises(Exception) as e:
        Sandbox.create("sdktpl:nope")
    assert "has no tag 'nope'" in str(e.value), str(e.value)
    tags = {t.tag: t.build_id for t in Template.get_tags("sdktpl")}
    assert tags == {"default": v2.build_id, "v1": v1.build_id, "v2": v2.build_id}, tags
    # Back to v1 as the default, as the rest of the test expects.
    Template.assign_tags("sdktpl:v1", "default")
    check_tag_history(v1.build_id, v2.build_id)


def check_tag_history(v1, v2):
    """E2B's tag count, exists, groups and assignment lists, through the SDK's own
    client: `default` named v1, then v2, then v1 again; prod came and went."""
    from e2b.api.client.api.tags import (get_templates_template_id_tags_count as count, get_templates_template_id_tags_exists as exists,
                                         get_templates_template_id_tags_groups as groups, get_templates_template_id_tags_tag_assignments as assignments)
    from e2b.api.client_sync import get_api_client
    from e2b.connection_config import ConnectionConfig
    client = get_api_client(ConnectionConfig(api_key=API_KEY, api_url=os.environ["E2B_API_URL"]))
    assert count.sync("sdktpl", client=client).total == 3
    there = exists.sync("sdktpl", client=client, tag=" V2 ")
    assert there.exists and there.normalized_tag == "v2", there
    assert not exists.sync("sdktpl", client=client, tag="prod").exists
    first = assignments.sync("sdktpl", "default", client=client, limit=2)
    assert [str(a.build_id) for a in first.data] == [v1, v2] and first.next_cursor, first
    rest = assignments.sync("sdktpl", "default", client=client, limit=2, cursor=first.next_cursor)
    assert [str(a.build_id) for a in rest.data] == [v1] and rest.next_cursor is None, rest
    assert assignments.sync_detailed("sdktpl", "prod", client=client).status_code == 404
    page = groups.sync("sdktpl", client=client, assignment_limit=2, search="def")
    assert [(g.tag, [str(a.build_id) for a in g.assignments], g.has_more) for g in page.tags] == [("default", [v1, v2], True)], page
    by_name = groups.sync("sdktpl", client=client, sort=groups.GetTemplatesTemplateIDTagsGroupsSort.NAME_ASC, tags_limit=2)
    assert [g.tag for g in by_name.tags] == ["default", "v1"] and by_name.next_cursor, by_name


def test_the_official_sdk_hears_why_a_build_failed(registry, builds_server, tmp_path):
    from e2b import Template
    from e2b.exceptions import BuildException
    push(registry, "bb", "1", busybox_image(), CONFIG)
    bad = Template(file_context_path=str(tmp_path)).from_image(f"{registry}/bb:1").run_cmd("echo about-to-fail && exit 3")
    with pytest.raises(BuildException) as e:
        Template.build(bad, "sdkbad")
    assert "exited with 3" in str(e.value) and "about-to-fail" in str(e.value), str(e.value)
    assert not Template.exists("sdkbad")
    # The same, in the background: the SDK's status call says which step failed and why.
    started = Template.build_in_background(bad, "sdkbad")

    def ended():
        status = Template.get_build_status(started, logs_offset=0)
        return status if status.status.value not in ("waiting", "building") else None

    status = wait_until(ended, "the background build to end", timeout=300, interval=0.2)
    assert status.status.value == "error" and status.reason.step == "1" and "exited with 3" in status.reason.message, status
    assert any("about-to-fail" in entry.message for entry in status.log_entries), status.log_entries
    missing = Template(file_context_path=str(tmp_path)).from_image(f"{registry}/bb:nope")
    with pytest.raises(BuildException) as e:
        Template.build(missing, "sdkbad")
    assert "was not found in its registry" in str(e.value), str(e.value)


def test_api_builds_may_not_reach_registries_on_the_servers_machine(registry, server, tmp_path):
    """The session's server lists no registry: a tenant's image reference naming this
    machine (or a private or link-local address) is refused before anything is sent,
    also when only resolving its name tells (`LocalHost` is not `localhost` to a
    comparison, but is to the resolver)."""
    from e2b import Template
    from e2b.exceptions import BuildException
    port = registry.rsplit(":", 1)[1]
    for ref in (f"{registry}/bb:1", f"LocalHost:{port}/bb:1", "169.254.169.254/latest:meta", "10.1.2.3:5000/x:1"):
        t = Template(file_context_path=str(tmp_path)).from_image(ref)
        with pytest.raises(BuildException) as e:
            Template.build(t, "sdkbad")
        assert "names a registry on the server's own machine or private network" in str(e.value), str(e.value)
    shutil.rmtree(shared_home() / "templates" / "sdkbad", ignore_errors=True)


def test_an_aws_login_with_a_region_that_is_no_region_is_refused_before_any_call(server, tmp_path):
    """`from_aws_registry`'s region names ECR's API host, so one that could name another
    host is the caller's mistake, answered before the build starts (and before any
    request leaves). The login itself is tested in hutch-oci/tests/registry.rs."""
    from e2b import Template
    from e2b.exceptions import BuildException
    # A loopback image: were the region not checked first, the pull would be refused as
    # a registry on the server's machine, and still nothing would leave it.
    t = Template(file_context_path=str(tmp_path)).from_aws_registry(
        "127.0.0.1:9/app:1", access_key_id="AKIAHUTCHTEST0000001",
        secret_access_key="not-a-secret", region="evil.example.com/")
    try:
        with pytest.raises(BuildException) as e:
            Template.build(t, "sdkaws")
        assert "`evil.example.com/` is not an AWS region" in str(e.value), str(e.value)
        assert not (shared_home() / "templates" / "sdkaws" / "template.json").exists()
    finally:
        shutil.rmtree(shared_home() / "templates" / "sdkaws", ignore_errors=True)
