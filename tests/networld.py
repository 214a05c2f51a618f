"""The world sandboxes reach in tests: loopback listeners stand in for hosts on the
internet, and `hutch serve` gets a map (HUTCH_NET_TEST_MAP) from the addresses and names
guests use to those listeners. The stack dials only what the map names; anything else is
refused and written to the violations file, which the network tests read. No packet
leaves this machine.

HTTPS hosts for the TLS inspection tests come with certificates the `openssl` CLI makes
at start: inspect.test and plain.test signed by a test CA (`tls_ca`, which the server
fixture gives `hutch serve --upstream-ca`), untrusted.test by another CA nobody trusts."""

import hashlib
import json
import secrets
import socket
import socketserver
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Public-looking addresses (in no special-purpose range, so `public` rules reach them);
# the map sends them to loopback.
WEB = "93.184.216.34"
API = "93.184.216.40"
HTTP_BODY = b"hello from the test host\n"
# The HTTPS hosts, by name and address (port 443 of each goes to its own listener).
TLS_HOSTS = {"inspect.test": "93.184.216.60", "plain.test": "93.184.216.61", "untrusted.test": "93.184.216.62",
             "other.test": "93.184.216.63"}
INSPECT, PLAIN, UNTRUSTED, OTHER = TLS_HOSTS.values()
# The SOCKS5 proxy a sandbox's `egressProxy` names, and the login it takes.
SOCKS, SOCKS_PORT = "93.184.216.70", 1080
SOCKS_USER, SOCKS_PASSWORD = "hutch-user", "hutch-proxy-password"


class _Web(BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(len(HTTP_BODY)))
        self.end_headers()
        self.wfile.write(HTTP_BODY)

    def log_message(self, *args):
        pass


class _Echo(socketserver.BaseRequestHandler):
    """Reads until the guest half-closes, then answers everything it got and closes."""

    def handle(self):
        data = b""
        while chunk := self.request.recv(65536):
            data += chunk
        self.request.sendall(b"echo:" + data)


class _UdpEcho(socketserver.BaseRequestHandler):
    def handle(self):
        data, sock = self.request
        sock.sendto(b"udp:" + data, self.client_address)


class _Tls(BaseHTTPRequestHandler):
    """Answers a GET with what arrived: the path, the Host and X-Hutch-Test headers, and
    only a hash of the query, Authorization and X-Api-Key (a secret placed there must not
    come back to the guest in a body). A header sent more than once comes back as a list of its values."""

    protocol_version = "HTTP/1.1"  # keep-alive: a client may send several requests on one connection

    def do_GET(self):
        if self.path.startswith("/bytes/"):
            return self.send_bytes(int(self.path.removeprefix("/bytes/")))

        def one(values):
            return None if not values else values[0] if len(values) == 1 else values
        def hashed(name):
            return one([hashlib.sha256(v.encode("latin-1")).hexdigest() for v in self.headers.get_all(name, [])])
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.echo_upgraded(hashed("Authorization"))
        path, _, query = self.path.partition("?")
        seen = {
            "server": self.server.name,
            "path": path,
            "query_sha256": hashlib.sha256(query.encode()).hexdigest() if query else None,
            "host": one(self.headers.get_all("Host", [])),
            "x_hutch_test": one(self.headers.get_all("X-Hutch-Test", [])),
            "authorization_sha256": hashed("Authorization"),
            "x_api_key_sha256": hashed("X-Api-Key"),
        }
        self.server.seen.append(seen)
        body = (json.dumps(seen) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def echo_upgraded(self, authorization_sha256):
        """A WebSocket's server in miniature: switches protocols (saying in headers what
        X-Hutch-Test and Authorization it got), then answers each read with `echo:` and it."""
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("X-Seen-Hutch-Test", self.headers.get("X-Hutch-Test", ""))
        self.send_header("X-Seen-Authorization-Sha256", authorization_sha256 or "")
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while data := self.connection.recv(65536):
            self.connection.sendall(b"echo:" + data)

    def send_bytes(self, n: int):
        """`n` zero bytes, for throughput (bench/inspection.py): MiB by MiB, not held whole."""
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        chunk = bytes(1 << 20)
        while n > 0:
            self.wfile.write(chunk[:min(n, len(chunk))])
            n -= len(chunk)

    def log_message(self, *args):
        pass


class _TlsServer(ThreadingHTTPServer):
    """An HTTPS host: the TLS handshake happens on the connection's own thread, so a
    client that gives up mid-handshake (hutch refusing this host's certificate) holds up
    no one else."""

    daemon_threads = True

    def __init__(self, name: str, cert: Path, key: Path, seen: list):
        super().__init__(("127.0.0.1", 0), _Tls)
        self.name, self.seen = name, seen
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.context.set_alpn_protocols(["http/1.1"])

    def finish_request(self, request, client_address):
        request.settimeout(30)
        # A head and a body are two writes: without this, Nagle holds the body for the
        # client's delayed ACK, 40 ms a request.
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            self.shutdown_request(tls)


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


# The sections `openssl req` and `openssl x509` read (no reliance on the host's openssl.cnf).
_CNF = """[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[leaf]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = DNS:{host}
"""
_P256 = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA (P-256, 30 days): its certificate's and key's paths."""
    (directory / "ca.cnf").write_text(_CNF.format(host="unused"))
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl(directory, "req", "-x509", "-config", "ca.cnf", "-extensions", "ca", *_P256, "-keyout", key.name, "-out", cert.name,
             "-days", "30", "-subj", f"/CN={name}")
    return cert, key


def make_leaf(directory: Path, host: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A server certificate for `host` (its only SAN) signed by `ca`."""
    cnf = directory / f"{host}.cnf"
    cnf.write_text(_CNF.format(host=host))
    cert, key, csr = directory / f"{host}.pem", directory / f"{host}.key", directory / f"{host}.csr"
    _openssl(directory, "req", "-new", "-config", cnf.name, *_P256, "-keyout", key.name, "-out", csr.name, "-subj", f"/CN={host}")
    _openssl(directory, "x509", "-req", "-in", csr.name, "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-set_serial", hex(secrets.randbits(63) | 1),
             "-days", "30", "-extfile", cnf.name, "-extensions", "leaf", "-out", cert.name)
    return cert, key


def cert_sha256(pem: Path) -> str:
    """The SHA-256 of a PEM certificate's DER, as a guest's `getpeercert(True)` hashes."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.read_text())).hexdigest()


class _Threaded(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _pipe(src: socket.socket, dst: socket.socket):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class _Socks5(socketserver.BaseRequestHandler):
    """A SOCKS5 proxy (RFC 1928, login by RFC 1929) that reaches the test world's hosts
    itself (`server.routes`: name or address and port → loopback listener) and records
    every CONNECT it was asked for in `server.seen`."""

    def handle(self):
        c = self.request
        def read(n):
            data = b""
            while len(data) < n:
                chunk = c.recv(n - len(data))
                if not chunk:
                    raise ConnectionError("closed")
                data += chunk
            return data
        try:
            _, n = read(2)
            methods = read(n)
            if 2 not in methods:
                c.sendall(b"\x05\xff")
                return
            c.sendall(b"\x05\x02")
            _, ulen = read(2)
            user = read(ulen).decode()
            (plen,) = read(1)
            password = read(plen).decode()
            if (user, password) != (SOCKS_USER, SOCKS_PASSWORD):
                c.sendall(b"\x01\x01")
                return
            c.sendall(b"\x01\x00")
            _, cmd, _, atyp = read(4)
            if atyp == 3:
                host = read(read(1)[0]).decode()
            elif atyp == 1:
                host = socket.inet_ntoa(read(4))
            else:
                return
            port = int.from_bytes(read(2), "big")
            self.server.seen.append({"user": user, "host": host, "port": port, "by_name": atyp == 3})
            target = self.server.routes.get(f"{host}:{port}")
            if cmd != 1 or target is None:
                c.sendall(b"\x05\x04\x00\x01" + bytes(6))
                return
            up = socket.create_connection(target, timeout=10)
            c.sendall(b"\x05\x00\x00\x01" + bytes(6))
            t = threading.Thread(target=_pipe, args=(up, c), daemon=True)
            t.start()
            _pipe(c, up)
            t.join(30)
            up.close()
        except (OSError, ConnectionError):
            pass


class NetWorld:
    def __init__(self, directory: Path):
        self.web = ThreadingHTTPServer(("127.0.0.1", 0), _Web)
        self.web.paths = []  # every path example.test's web server answered
        self.echo = _Threaded(("127.0.0.1", 0), _Echo)
        self.udp = socketserver.ThreadingUDPServer(("127.0.0.1", 0), _UdpEcho)
        for s in (self.web, self.echo, self.udp):
            threading.Thread(target=s.serve_forever, daemon=True).start()
        # What a host's kernel does with a datagram for 0.0.0.0:P (it delivers it to its
        # own 127.0.0.1:P): the map does the same, so one the stack let through arrives.
        self.loopback_probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.loopback_probe.bind(("127.0.0.1", 0))
        self.loopback_probe.setblocking(False)
        # A DNS server that never answers, for names under silent.test.
        self.silent_dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.silent_dns.bind(("127.0.0.1", 0))
        self.silent_dns.setblocking(False)
        # The HTTPS world: two CAs, a certificate per host, a listener per host, and every
        # request any of them answered (`tls_seen`), in order.
        tls = directory / "tls"
        tls.mkdir()
        self.tls_ca, ca_key = make_ca(tls, "hutch-test-ca")
        self.tls_other_ca, other_key = make_ca(tls, "hutch-untrusted-ca")
        self.tls_seen: list[dict] = []
        self.tls_servers: dict[str, _TlsServer] = {}
        self.tls_cert_sha256: dict[str, str] = {}
        for host in TLS_HOSTS:
            cert, key = make_leaf(tls, host, (self.tls_other_ca, other_key) if host == "untrusted.test" else (self.tls_ca, ca_key))
            self.tls_servers[host] = _TlsServer(host.removesuffix(".test"), cert, key, self.tls_seen)
            self.tls_cert_sha256[host] = cert_sha256(cert)
        self.plain_cert_sha256 = self.tls_cert_sha256["plain.test"]
        for s in self.tls_servers.values():
            threading.Thread(target=s.serve_forever, daemon=True).start()
        # The SOCKS5 proxy, which reaches example.test's web server by name or address.
        self.socks = _Threaded(("127.0.0.1", 0), _Socks5)
        self.socks.seen = []
        self.socks.routes = {f"example.test:80": self.web.server_address, f"{WEB}:80": self.web.server_address}
        threading.Thread(target=self.socks.serve_forever, daemon=True).start()
        self.socks_open = True
        self.violations = directory / "net-violations"
        self.violations.write_text("")
        self.map = directory / "net-map.json"
        at = lambda s: f"127.0.0.1:{s.server_address[1]}"
        self.map.write_text(json.dumps({
            "tcp": {f"{WEB}:80": at(self.web), f"{WEB}:7": at(self.echo), f"{API}:80": at(self.web),
                    **{f"{ip}:443": at(self.tls_servers[host]) for host, ip in TLS_HOSTS.items()},
                    f"{SOCKS}:{SOCKS_PORT}": at(self.socks)},
            "udp": {f"{WEB}:7": at(self.udp), f"0.0.0.0:{self.probe_port}": f"127.0.0.1:{self.probe_port}"},
            "dns": {"silent.test": f"127.0.0.1:{self.silent_dns.getsockname()[1]}"},
            # The host's loopback answers echo itself.
            "icmp": {WEB: "127.0.0.1"},
            "names": {
                "example.test": [WEB],
                "api.example.test": [API],
                "rebind.example.test": ["127.0.0.1"],
                "metadata.example.test": ["169.254.169.254"],
                **{host: [ip] for host, ip in TLS_HOSTS.items()},
                "socks.test": [SOCKS],
            },
            "violations": str(self.violations),
        }))

    @property
    def probe_port(self) -> int:
        return self.loopback_probe.getsockname()[1]

    @staticmethod
    def drained(sock: socket.socket) -> int:
        """How many datagrams `sock` holds; it holds none afterwards."""
        n = 0
        while True:
            try:
                sock.recv(65536)
                n += 1
            except BlockingIOError:
                return n

    def violation_lines(self) -> list[str]:
        return [l for l in self.violations.read_text().splitlines() if l]

    def tls_requests(self, server: str) -> list[dict]:
        """What the HTTPS host `server` ("inspect", "plain" or "untrusted") answered."""
        return [r for r in self.tls_seen if r["server"] == server]

    def stop_socks(self):
        """The proxy goes down: its port refuses connections from now on."""
        if self.socks_open:
            self.socks.shutdown()
            self.socks.server_close()
            self.socks_open = False

    def close(self):
        self.stop_socks()
        for s in (self.web, self.echo, self.udp, *self.tls_servers.values()):
            s.shutdown()
            s.server_close()
        self.loopback_probe.close()
        self.silent_dns.close()
