"""The world sandboxes reach in tests: loopback listeners stand in for hosts on the
internet, and `hutch serve` gets a map (HUTCH_NET_TEST_MAP) from the addresses and names
guests use to those listeners. The stack dials only what the map names; anything else is
refused and written to the violations file, which the network tests read. No packet
leaves this machine."""

import json
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Public-looking addresses (in no special-purpose range, so `public` rules reach them);
# the map sends them to loopback.
WEB = "93.184.216.34"
API = "93.184.216.40"
HTTP_BODY = b"hello from the test host\n"


class _Web(BaseHTTPRequestHandler):
    def do_GET(self):
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


class _Threaded(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class NetWorld:
    def __init__(self, directory: Path):
        self.web = ThreadingHTTPServer(("127.0.0.1", 0), _Web)
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
        self.violations = directory / "net-violations"
        self.violations.write_text("")
        self.map = directory / "net-map.json"
        at = lambda s: f"127.0.0.1:{s.server_address[1]}"
        self.map.write_text(json.dumps({
            "tcp": {f"{WEB}:80": at(self.web), f"{WEB}:7": at(self.echo), f"{API}:80": at(self.web)},
            "udp": {f"{WEB}:7": at(self.udp), f"0.0.0.0:{self.probe_port}": f"127.0.0.1:{self.probe_port}"},
            "dns": {"silent.test": f"127.0.0.1:{self.silent_dns.getsockname()[1]}"},
            # The host's loopback answers echo itself.
            "icmp": {WEB: "127.0.0.1"},
            "names": {
                "example.test": [WEB],
                "api.example.test": [API],
                "rebind.example.test": ["127.0.0.1"],
                "metadata.example.test": ["169.254.169.254"],
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

    def close(self):
        for s in (self.web, self.echo, self.udp):
            s.shutdown()
            s.server_close()
        self.loopback_probe.close()
        self.silent_dns.close()
