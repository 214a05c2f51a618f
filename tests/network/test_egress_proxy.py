"""E2B's `network.egressProxy` through the official SDK: after the policy allows a
connection, the host opens it through a SOCKS5 proxy (RFC 1928, login by RFC 1929),
asking for the address the policy checked, never a name; the proxy's password is in no API answer or
log; and with the proxy down, connections fail instead of going direct. The proxy is a
loopback listener behind the test map (tests/networld.py)."""

from e2b import CommandExitException, Sandbox

from conftest import wait_until
from networld import HTTP_BODY, SOCKS_PASSWORD, SOCKS_PORT, SOCKS_USER, WEB


def run(sbx, command: str) -> tuple[int, str, str]:
    try:
        r = sbx.commands.run(command, timeout=120)
    except CommandExitException as e:
        return e.exit_code, e.stdout, e.stderr
    return r.exit_code, r.stdout, r.stderr


def test_tcp_goes_through_the_proxy_and_fails_closed_when_it_is_down(server, net_world):
    network = {
        "allow_out": ["example.test"],
        "deny_out": ["0.0.0.0/0"],
        "egress_proxy": {"address": f"socks.test:{SOCKS_PORT}", "username": SOCKS_USER, "password": SOCKS_PASSWORD},
    }
    sbx = Sandbox.create("base", network=network, timeout=300)
    try:
        seen = len(net_world.socks.seen)
        code, out, err = run(sbx, "curl -sS --max-time 20 http://example.test/")
        assert (code, out) == (0, HTTP_BODY.decode()), err
        assert net_world.socks.seen[seen:] == [{"user": SOCKS_USER, "host": WEB, "port": 80, "by_name": False}]

        api = server.api()
        for path in (f"/sandboxes/{sbx.sandbox_id}", f"/sandboxes/{sbx.sandbox_id}/network"):
            view = api.get(path)
            assert view.status_code == 200 and SOCKS_PASSWORD not in view.text, path
            assert SOCKS_USER in view.text, f"{path} shows the proxy, without its password"
        assert SOCKS_PASSWORD not in (server.home / "serve.log").read_text(errors="replace")

        net_world.stop_socks()
        code, out, err = run(sbx, "curl -sS --max-time 20 http://example.test/")
        # Refused at once (the stack's RST), never answered by a direct connection.
        assert code == 7 and out == "", (code, out, err)

        def denial():
            log = api.get(f"/sandboxes/{sbx.sandbox_id}/network").json()["log"]
            return [d for d in log["denials"] if "egress proxy" in d["message"]]
        wait_until(denial, "a denial naming the egress proxy in the network log", timeout=15)
    finally:
        sbx.kill()
