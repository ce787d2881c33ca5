"""The soak's file-system kill points (tests/soak/soak.py), loaded by every Python process the soak
starts (PYTHONPATH holds this folder only when the soak asks for it; nothing else imports it).

SOAK_FAULT="count": record this process's os.replace / os.rename / os.fsync / os.unlink / os.rmdir
calls on paths under SOAK_FAULT_ROOTS and append {"rank", "counts", "calls"} to SOAK_FAULT_FILE at
exit (calls: [op, paths] in order).
SOAK_FAULT="OP:N:before|after": in the process whose RANK equals SOAK_FAULT_RANK ("" = a process
without RANK: a single-process stage), right before or after the N-th OP call on a path matching
the regular expression SOAK_FAULT_PATH (searched in the path from the first root on, or in
"EAGLEFORGE_CACHE/..." from the second), append where it is to SOAK_FAULT_FILE and stop this
process (SIGSTOP); the soak then kills the stage's whole process tree with SIGKILL, so the stage
dies exactly between two file-system operations (after a shard's fsync, before its rename;
between the two renames of a directory swap; half-way through a checkpoint's removal). The
stage's own code is not changed.
"""

import os

OPS = ("replace", "rename", "fsync", "unlink", "rmdir")
_counts: dict = {}
_calls: list = []
_real = {name: getattr(os, name) for name in OPS}


def _append(line: str) -> None:
    fd = os.open(os.environ["SOAK_FAULT_FILE"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def dump() -> None:
    """Append this process's counts (count mode); called at exit."""
    import json

    if _counts or os.environ.get("SOAK_FAULT") == "count":
        _append(json.dumps({"rank": os.environ.get("RANK", ""), "pid": os.getpid(), "counts": _counts, "calls": _calls}))


def _path(name: str, args: tuple, kwargs: dict) -> list[str]:
    """The absolute paths an OP call touches (a file descriptor or dir_fd resolved through /proc)."""
    if not args:
        return []
    if name == "fsync":
        fd = args[0] if isinstance(args[0], int) else args[0].fileno()
        try:
            return [os.readlink(f"/proc/self/fd/{fd}")]
        except OSError:
            return []
    paths = [os.fspath(a) for a in args[:2 if name in ("replace", "rename") else 1] if isinstance(a, (str, bytes, os.PathLike))]
    paths = [p.decode() if isinstance(p, bytes) else p for p in paths]
    dir_fd = kwargs.get("dir_fd") or kwargs.get("src_dir_fd")
    base = None
    if dir_fd is not None:
        try:
            base = os.readlink(f"/proc/self/fd/{dir_fd}")
        except OSError:
            base = None
    return [os.path.join(base, p) if base and not os.path.isabs(p) else os.path.abspath(p) for p in paths]


def _relative(path: str, roots: tuple) -> str:
    """`path` from the first root (RUN) on, or EAGLEFORGE_CACHE/... from the second."""
    for root, name in zip(roots, ("", "EAGLEFORGE_CACHE/")):
        if path.startswith(root):
            return name + path[len(root):]
    return path


def _install() -> None:
    spec = os.environ.get("SOAK_FAULT")
    if not spec:
        return
    import atexit
    import functools
    import json
    import re
    import signal

    roots = tuple(os.path.join(os.path.abspath(r), "") for r in os.environ.get("SOAK_FAULT_ROOTS", "").split(os.pathsep) if r)
    target, matches = None, 0
    if spec != "count":
        if os.environ.get("RANK", "") != os.environ.get("SOAK_FAULT_RANK", ""):
            return
        op, n, when = spec.split(":")
        target = (op, int(n), when, re.compile(os.environ.get("SOAK_FAULT_PATH", "")))

    def wrap(name: str):
        real = _real[name]

        # functools.wraps: the same name, module, docstring and signature as the real call (the
        # data stage builds its prompts from the standard library's documented functions, os's too)
        @functools.wraps(real)
        def hooked(*args, **kwargs):
            nonlocal matches
            paths = _path(name, args, kwargs)
            if not paths or not paths[0].startswith(roots):
                return real(*args, **kwargs)
            _counts[name] = _counts.get(name, 0) + 1
            if target is None:
                _calls.append([name, paths])
            hit = False
            if target is not None and target[0] == name and target[3].search(_relative(paths[0], roots)):
                matches += 1
                hit = matches == target[1]
            if hit and target[2] == "before":
                stop(name, paths)
            result = real(*args, **kwargs)
            if hit and target[2] == "after":
                stop(name, paths)
            return result

        return hooked

    def stop(name: str, paths: list[str]) -> None:
        _append(json.dumps({"hit": True, "op": name, "n": matches, "when": target[2], "paths": paths,
                            "pid": os.getpid(), "rank": os.environ.get("RANK", "")}))
        os.kill(os.getpid(), signal.SIGSTOP)

    for name in OPS:
        hooked = wrap(name)
        for group in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks):
            if _real[name] in group:  # shutil.rmtree asks these sets which calls take a dir_fd
                group.add(hooked)
        setattr(os, name, hooked)
    atexit.register(dump)


_install()
