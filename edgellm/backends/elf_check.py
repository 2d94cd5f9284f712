"""A look at a shared library's ELF headers before dlopen sees it.

dlopen maps a library's segments where its program headers say: a truncated copy (an
interrupted download or adb push) had them reach past the file's end, and the first access
there killed the process with SIGBUS, no message. A library for another machine (an aarch64
bundle on an x86 host) or an empty file came back as "cannot open shared object file: No such
file or directory" about a file that exists. Here each is a reason in words; None: nothing
found wrong (dlopen may still refuse, with its own message).
"""
from __future__ import annotations

import platform
import struct
from pathlib import Path

_MACHINES = {3: "x86 (32-bit)", 40: "arm (32-bit)", 62: "x86_64", 183: "aarch64", 243: "riscv"}
_HOST = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}


def problem(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = f.seek(0, 2)
            if len(head) < 64 or head[:4] != b"\x7fELF":
                return f"{path} is not a shared library ({size} bytes, no ELF header)"
            if head[4] != 2 or head[5] != 1:
                return f"{path} is not a 64-bit little-endian library"
            e_type, e_machine = struct.unpack_from("<HH", head, 16)
            machine = _HOST.get(platform.machine().lower())
            if machine is not None and e_machine != machine:
                return (f"{path} is a library for {_MACHINES.get(e_machine, f'ELF machine {e_machine}')}; this "
                        f"CPU is {platform.machine()}")
            if e_type != 3:
                return f"{path} is not a shared library (ELF type {e_type})"
            phoff, shoff = struct.unpack_from("<QQ", head, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
            if phentsize < 56:      # an ELF64 program header: a damaged copy can say anything
                return f"{path} is damaged (program header entries of {phentsize} bytes)"
            need = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
            if size >= phoff + phentsize * phnum:
                f.seek(phoff)
                table = f.read(phentsize * phnum)
                for i in range(phnum):
                    p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
                    if p_type == 1:      # PT_LOAD: mapped from the file
                        need = max(need, p_offset + p_filesz)
            if size < need:
                return f"{path} is truncated ({size} bytes; its headers need {need})"
    except struct.error:      # a table shorter than its header says
        return f"{path} is damaged (its program header table is cut short)"
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    return None
