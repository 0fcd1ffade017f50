"""Keeps a build's processes from outliving the Python process that started it.

`build.run_builds` starts ninja, and ninja each nvcc, through this script (run
as `python -S -I build_guard.py ...`, standard library only, so that it starts
in milliseconds and never imports flashjit):

    build_guard.py ninja CALLER_PID -- NINJA ARGS...
    build_guard.py edge CALLER_PID TIMES_FILE -- COMMAND ARGS...

Why a guard, and not only a parent-death signal on ninja: ninja runs each
command through /bin/sh in a process group of its own, and when ninja dies by
SIGKILL nothing signals those groups; nvcc's own children (cicc, ptxas, the
host compiler, the linker) never hear of it either. So:

- `ninja` mode arms PR_SET_PDEATHSIG (SIGKILL) on itself and then execs ninja,
  which keeps the signal: ninja dies with the Python process. It exports its pid
  as FLASHJIT_BUILD_NINJA_PID for the edges.
- `edge` mode watches both the Python process and ninja (pidfd, else polling)
  and runs the command in its own process group (the one ninja made for the
  edge's shell). When either watched process dies, or ninja forwards SIGTERM,
  SIGINT or SIGHUP (it does so on an interrupt), it kills that whole group with
  SIGKILL: the shell, nvcc and every compiler process under it. Otherwise it
  writes "SECONDS RETURNCODE" to TIMES_FILE and exits with the command's status.
  While the command runs, TIMES_FILE.pgid holds the group's id, so that the
  build can kill it on an interrupt without waiting for ninja to pass it on.
"""

import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
NINJA_PID_ENV = "FLASHJIT_BUILD_NINJA_PID"
POLL_SECONDS = 0.2


def _arm_parent_death_signal(sig: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the edges' guards still watch the caller


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie counts as dead: it will never compile again)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def run_ninja(caller: int, argv: list[str]) -> None:
    _arm_parent_death_signal(signal.SIGKILL)
    if os.getppid() != caller:  # the caller died before the signal was armed
        os._exit(1)
    os.environ[NINJA_PID_ENV] = str(os.getpid())
    os.execv(argv[0], argv)


def _kill_own_group(*_args) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(137)


def _pidfd(pid: int):
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def run_edge(caller: int, times_file: str, argv: list[str]) -> int:
    watched = [caller]
    if os.environ.get(NINJA_PID_ENV, "").isdigit():
        watched.append(int(os.environ[NINJA_PID_ENV]))
    try:
        shared = os.getpgrp() in {os.getpgid(pid) for pid in watched}
    except ProcessLookupError:
        shared = False
    if shared:  # a ninja that did not isolate its commands: never signal the caller's group
        os.setpgid(0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _kill_own_group)
    group_file = times_file + ".pgid"  # read by build._stop, which kills the group on an interrupt
    try:
        with open(group_file, "w") as f:
            f.write(str(os.getpgrp()))
    except OSError:
        group_file = None
    fds = [_pidfd(pid) for pid in watched]
    if not all(_alive(pid) for pid in watched):
        sys.stderr.write("flashjit: the build's process exited before this compile started\n")
        return 1
    started = time.monotonic()
    child = os.fork()
    if child == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            sys.stderr.write(f"flashjit: cannot run {argv[0]}: {exc}\n")
        os._exit(127)
    child_fd = _pidfd(child)
    poller = select.poll() if child_fd is not None and None not in fds else None
    if poller is not None:
        for fd in (*fds, child_fd):
            poller.register(fd, select.POLLIN)
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        if not all(_alive(pid) for pid in watched):
            _kill_own_group()
        if poller is not None:
            poller.poll()
        else:
            time.sleep(POLL_SECONDS)
    code = os.waitstatus_to_exitcode(status)
    code = 128 - code if code < 0 else code
    try:
        if group_file is not None:
            os.unlink(group_file)
        with open(times_file, "w") as f:
            f.write(f"{time.monotonic() - started:.3f} {code}\n")
    except OSError:
        pass  # the times are a report only
    return code


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    split = rest.index("--")
    head, command = rest[:split], rest[split + 1:]
    if mode == "ninja":
        run_ninja(int(head[0]), command)
    return run_edge(int(head[0]), head[1], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
