"""Runs inside the sandbox (`trace_common.rewards.sandbox`), as a script of its own:
``python -I -S _sandbox_harness.py JOB FD``. Standard library only: the sandbox's interpreter
runs isolated, without site-packages.

It reads the job (code, tests, nonce) and deletes the file, installs an audit hook, runs the
code and then each test in one namespace, and reports each test's outcome as a JSON line,
stamped with the nonce, on the inherited descriptor FD. What the code prints goes to the
sandbox's stdout/stderr and counts for nothing.

The audit hook refuses, with PermissionError: every socket operation; creating processes
(fork, exec, spawn, system, subprocess) and signalling them; loading native code through
ctypes; tracing, and the garbage collector's object walks; opening any file outside the sandbox's directory except the standard library
and /dev/null / urandom for reading; and changing files outside the directory.
"""

import json
import os
import sys
import sysconfig

FILE_EVENTS = {  # event -> positions of its path arguments
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
    "os.replace": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,),
    "os.utime": (0,), "os.symlink": (0, 1), "os.link": (0, 1), "os.chdir": (0,),
    "os.chroot": (0,), "shutil.rmtree": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
}  # fmt: skip
REFUSED_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "os.startfile",
    "sys._current_frames", "gc.get_referrers", "gc.get_referents",
    "gc.get_objects", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof",
    "sys.setprofile", "sys.settrace", "os.putenv", "os.unsetenv", "resource.setrlimit",
    "resource.prlimit", "mmap.__new__", "socket.sethostname",
}  # fmt: skip
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _inside(path, roots):
    if isinstance(path, int):  # an open descriptor: what it names was checked when opened
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    full = os.path.realpath(path)
    return any(full == r or full.startswith(r + os.sep) for r in roots)


def make_hook(root):
    readable = {root, "/dev/null", "/dev/urandom"}
    for key in ("stdlib", "platstdlib"):
        readable.add(os.path.realpath(sysconfig.get_paths()[key]))
    writable = {root, "/dev/null"}

    def hook(event, args):
        if event in REFUSED_EVENTS or event.startswith("socket."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and flags & WRITE_FLAGS
            )
            if not _inside(path, writable if writing else readable):
                raise PermissionError(f"sandbox: opening {path!r} is not allowed")
        elif event in ("os.listdir", "os.scandir"):
            path = args[0] if args and args[0] is not None else "."
            if not _inside(path, readable):
                raise PermissionError(f"sandbox: listing {path!r} is not allowed")
        elif event in FILE_EVENTS:
            for i in FILE_EVENTS[event]:
                if i < len(args) and args[i] is not None and not _inside(args[i], writable):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} is not allowed")

    return hook


def main():
    job_path, fd = sys.argv[1], int(sys.argv[2])
    with open(job_path) as f:
        job = json.load(f)
    os.remove(job_path)
    out = os.fdopen(fd, "w", buffering=1)
    nonce, code, tests = job["nonce"], job["code"], job["tests"]
    del job

    def report(event, **fields):
        out.write(json.dumps({"nonce": nonce, "event": event, **fields}) + "\n")
        out.flush()

    sys.addaudithook(make_hook(os.path.realpath(os.getcwd())))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<completion>", "exec"), namespace)
    except MemoryError:
        report("memory")
        return
    except BaseException as e:  # the completion's own failure, SystemExit included
        report("error", detail=f"{type(e).__name__}: {e}"[:500])
        return
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)
            ok = True
        except MemoryError:
            report("memory")
            return
        except BaseException:
            ok = False
        report("test", index=index, ok=ok)
    report("done")


if __name__ == "__main__":
    main()
