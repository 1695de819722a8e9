"""No test, payload, benchmark or script names a place off this machine (RELIABILITY.md C.3, issue 20).

Everything under tests/, bench/ and scripts/ may send traffic only to 127.0.0.0/8 (listeners the test
owns) or into a network namespace it created. This test greps those trees for (1) IPv4 literals outside
127.0.0.0/8 and 0.0.0.0, and (2) name lookups or connections whose literal host is not loopback
(``gethostbyname('...')``, ``create_connection(('...', 80))``, ``urlopen('http://...')``, ``curl``, ...),
and fails naming file:line. Payload source kept in strings is text too, so it is covered. Header values
that are never looked up (``Origin: http://evil.example``) are not calls and stay allowed.

What this is not: a network monitor. It keeps the rule from regressing in the source; the sandbox tests
prove from inside the jail that there is no way out.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TREES = ("tests", "bench", "scripts")
SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".json", ".jsonl", ".toml", ".cfg", ".ini", ".md", ".txt"}

_IPV4 = re.compile(r"(?<![\w.=~<>])(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})(?![\w.]*\d)")
# A lookup or connection call, then its first quoted argument (a host, or a URL, or a (host, port) tuple).
_CALL = re.compile(r"\b(gethostbyname(?:_ex)?|gethostbyaddr|getaddrinfo|getnameinfo|create_connection|connect(?:_ex)?"
                   r"|HTTPS?Connection|urlopen|urlretrieve|requests\.\w+|httpx\.\w+|Request)"
                   r"\(\s*[\[(]?\s*(?:b|f|rb|fr)?(\\?['\"])(.*?)\2")
# (host, port) tuples on a line that sends, connects or binds: sendto(data, (HOST, PORT)) and the like.
_NET_LINE = re.compile(r"\b(sendto|sendmsg|connect|connect_ex|create_connection|bind|create_server)\(")
_TUPLE = re.compile(r"\(\s*(?:b|f)?(\\?['\"])([^'\"]*)\1\s*,\s*[\w{}]+\s*\)")
_SHELL = re.compile(r"\b(curl|wget|nslookup|dig|ping|telnet|ncat)\s+(?:-\S+\s+)*['\"]?([^\s'\"]+)")
_URL_HOST = re.compile(r"^[a-z][a-z0-9+.-]*://(\[[^\]]*\]|[^/:?#]*)", re.IGNORECASE)
_HOSTNAME = re.compile(r"^(\{\w*\}|[a-z0-9-]+)(\.[a-z0-9-]+)+$", re.IGNORECASE)
_LOOPBACK_NAMES = {"localhost", "::1", "[::1]", "0.0.0.0", ""}


def is_loopback(host: str) -> bool:
    """Loopback (or a bare format field such as ``{host}``, whose value this grep cannot see)."""
    host = host.strip().lower().rstrip(".")
    if host in _LOOPBACK_NAMES or host.endswith(".localhost") or re.fullmatch(r"\{\w*\}", host):
        return True
    parts = host.split(".")
    return len(parts) == 4 and all(p.isdigit() for p in parts) and parts[0] == "127"


def _host_of(argument: str) -> str:
    url = _URL_HOST.match(argument)
    if url:
        return url.group(1)
    return argument.split("/", 1)[0].rsplit(":", 1)[0]


def findings(text: str) -> list[tuple[int, str]]:
    """(line number, what) for every off-machine address or lookup in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _IPV4.finditer(line):
            octets = [int(g) for g in match.groups()]
            literal = match.group(0)
            if all(o <= 255 for o in octets) and octets[0] != 127 and literal != "0.0.0.0":
                found.append((number, f"IPv4 literal {literal} outside 127.0.0.0/8"))
        hosts = [(m.group(1), _host_of(m.group(3))) for m in _CALL.finditer(line)]
        if _NET_LINE.search(line):
            hosts += [("address", m.group(2)) for m in _TUPLE.finditer(line) if re.search(r"\w", m.group(2))]
        hosts += [(f"`{m.group(1)}`", _host_of(m.group(2))) for m in _SHELL.finditer(line)
                  if _HOSTNAME.match(_host_of(m.group(2))) or "://" in m.group(2)]
        for what, host in hosts:
            if not is_loopback(host):
                found.append((number, f"{what} on non-loopback host {host!r}"))
    return found


def test_no_test_payload_benchmark_or_script_names_an_offhost_address() -> None:
    bad = []
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file() or "__pycache__" in path.parts:
                continue
            for number, what in findings(path.read_text(errors="replace")):
                bad.append(f"{path.relative_to(REPO)}:{number}: {what}")
    assert not bad, "traffic could leave this machine (RELIABILITY.md C.3):\n" + "\n".join(bad)


def test_the_grep_catches_what_it_is_for() -> None:
    """The patterns have teeth (the samples are assembled, so this file holds none of them verbatim)."""
    doc, meta, dns = ".".join(["192", "0", "2", "1"]), ".".join(["169", "254", "169", "254"]), ".".join(["8"] * 4)
    bad = [f"socket.create_connection(('{doc}', 80))", f"s.sendto(b'x', ('{dns}', 53))", f"url = 'http://{meta}/'",
           "socket.gethostby" + "name('{token}.example.com')", "socket.getaddr" + "info('pypi.org', 443)",
           "urllib.request.url" + "open('https://example.org/x')", "subprocess.run('cur" + "l https://example.com')",
           "http.client.HTTPConn" + "ection('evil.example', 80)"]
    for sample in bad:
        assert findings(sample), sample
    good = ["socket.create_connection(('127.0.0.1', 80))", "urlopen(f'http://127.0.0.1:{port}/x')",
            "headers={'Origin': 'http://evil.example'}", "create_server(('0.0.0.0', 0))", "version 5.24.0",
            "urlopen(self.url + path)", "HTTPConnection('localhost', port)", "connect('{unix}')",
            "curl -s http://127.0.0.1:30000/metrics", "pip install torch==2.13.0.1", "dig the nonce out",
            "s.sendto(b'x', ('127.0.0.1', {udp_port}))", "the host listener.", "ping me",
            "socket.create_connection(('127.0.0.1', int(url.rsplit(':', 1)[1])))"]
    for sample in good:
        assert not findings(sample), (sample, findings(sample))
