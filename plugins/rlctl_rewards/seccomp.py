"""The code jail's seccomp filter: a classic-BPF program for ``bwrap --seccomp FD``, assembled here.

No libseccomp: the program is a few dozen ``struct sock_filter`` entries packed with ``struct``. What it
denies and why is in docs/security.md (section 4); ``rlctl_rewards.sandbox`` hands it to bwrap.
"""

from __future__ import annotations

import platform
import struct

# Syscall numbers per ABI: name -> (x86_64, aarch64). The mount API, io_uring and clone3 share the
# generic numbers on both.
_SYSCALLS = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442), "unshare": (272, 97), "setns": (308, 268),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89),
    "syslog": (103, 116),
}
DENIED_SYSCALLS = tuple(_SYSCALLS)  # all get EPERM; so do the socket and clone cases below
_SOCKET, _CLONE, _CLONE3 = (41, 198), (56, 220), (435, 435)
_ARCHES = {"x86_64": (0, 0xC000003E), "amd64": (0, 0xC000003E),  # machine -> (column above, AUDIT_ARCH_*)
           "aarch64": (1, 0xC00000B7), "arm64": (1, 0xC00000B7)}
_X32_BIT = 0x40000000
AF_NETLINK, AF_PACKET, SOCK_RAW, SOCK_PACKET, SOCK_TYPE_MASK = 16, 17, 3, 10, 0xF
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (NEWTIME, 0x80, is clone's signal byte)
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_LD_ABS, _AND, _JEQ, _JGE, _JSET, _RET = 0x20, 0x54, 0x15, 0x35, 0x45, 0x06
_KILL_PROCESS, _ALLOW, _ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24  # offsets in struct seccomp_data (args: low 32 bits, little-endian)


def seccomp_program(machine: str | None = None) -> bytes:
    """The jail's filter as ``struct sock_filter[]`` bytes for ``bwrap --seccomp FD``.

    Another ABI than the host's (i386 via int 0x80, x32) kills the process; the denied syscalls, packet,
    raw and netlink sockets and clone with a namespace flag return EPERM; clone3 returns ENOSYS.
    Raises ValueError on an architecture other than x86_64 and aarch64.
    """
    machine = machine or platform.machine()
    if machine.lower() not in _ARCHES:
        raise ValueError(f"no seccomp filter for the {machine} architecture")
    abi, audit_arch = _ARCHES[machine.lower()]

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    eperm, allow = op(_RET, _ERRNO | _EPERM), op(_RET, _ALLOW)
    prog = [op(_LD_ABS, _ARCH), op(_JEQ, audit_arch, 1, 0), op(_RET, _KILL_PROCESS), op(_LD_ABS, _NR)]
    if abi == 0:  # x32 syscalls run with the x86_64 audit arch and the x32 bit set in the number
        prog += [op(_JGE, _X32_BIT, 0, 1), op(_RET, _KILL_PROCESS)]
    for numbers in _SYSCALLS.values():
        prog += [op(_JEQ, numbers[abi], 0, 1), eperm]
    prog += [op(_JEQ, _CLONE3[abi], 0, 1), op(_RET, _ERRNO | _ENOSYS)]
    prog += [op(_JEQ, _CLONE[abi], 0, 4), op(_LD_ABS, _ARG0), op(_JSET, CLONE_NAMESPACES, 0, 1), eperm, allow]
    prog += [op(_JEQ, _SOCKET[abi], 0, 8),  # socket(domain, type, protocol)
             op(_LD_ABS, _ARG0), op(_JEQ, AF_PACKET, 5, 0), op(_JEQ, AF_NETLINK, 4, 0),
             op(_LD_ABS, _ARG1), op(_AND, SOCK_TYPE_MASK), op(_JEQ, SOCK_RAW, 1, 0),
             op(_JEQ, SOCK_PACKET, 0, 1), eperm]
    prog.append(allow)
    return b"".join(prog)
