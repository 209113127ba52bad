#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: llmgw maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: daemon
short_description: Run an llmgw service as a plain background process where there is no systemd
version_added: 0.1.0
description:
  - Starts, stops, restarts or reloads (C(SIGHUP)) a long-running command in its own session,
    with its output appended to a log file, for hosts without systemd as PID 1 (containers, a
    developer's machine running the all-in-one local fleet). Hosts with systemd use the unit files
    the roles install instead.
  - A process is identified by its pid, its start time (C(/proc/<pid>/stat) field 22) and the boot id,
    all recorded in O(pidfile), never by the pid alone, so a recycled pid is never signalled.
  - Stopping signals only the recorded process, as systemd's C(KillMode=process) does. Processes it
    started in their own process groups, such as engines an agent supervises, keep running.
author:
  - llmgw maintainers (!UNKNOWN)
options:
  name:
    description: Service name, for messages.
    type: str
    required: true
  command:
    description: The command line, as a list. Required unless O(state=stopped).
    type: list
    elements: str
  pidfile:
    description: Where the process identity is recorded.
    type: path
    required: true
  logfile:
    description: File the process's output is appended to. Defaults to O(pidfile) with C(.log) instead of its suffix.
    type: path
  chdir:
    description: Working directory of the process.
    type: path
  environment:
    description: Variables added to the module's environment for the process.
    type: dict
    default: {}
  state:
    description:
      - V(started) starts the process unless it runs; V(stopped) stops it if it runs.
      - V(restarted) stops and starts it; V(reloaded) sends it C(SIGHUP) (starting it when it does not run).
    type: str
    choices: [started, stopped, restarted, reloaded]
    default: started
  stop_timeout:
    description: Seconds to wait after C(SIGTERM) before C(SIGKILL).
    type: float
    default: 30
  startup_check:
    description: Seconds a started process must stay alive for the start to count; its log tail is shown when it does not.
    type: float
    default: 2
attributes:
  check_mode:
    support: full
    description: Reports what would be started, stopped or signalled, and does nothing.
  diff_mode:
    support: none
    description: A process has no file content to compare.
  platform:
    support: full
    platforms: posix
    description: Needs Linux C(/proc).
"""

EXAMPLES = r"""
- name: Run the control plane without systemd
  llmgw.fleet.daemon:
    name: llmgw-server
    command: [/opt/llmgw/venv/bin/llmgw, server, --config, /etc/llmgw/server.yaml]
    pidfile: /var/lib/llmgw/run/llmgw-server.pid

- name: Ask it to re-read its catalog
  llmgw.fleet.daemon:
    name: llmgw-server
    command: [/opt/llmgw/venv/bin/llmgw, server, --config, /etc/llmgw/server.yaml]
    pidfile: /var/lib/llmgw/run/llmgw-server.pid
    state: reloaded
"""

RETURN = r"""
pid:
  description: The process's pid after the task; null when it does not run.
  returned: always
  type: int
  sample: 4242
running:
  description: Whether the process runs after the task (in check mode, whether it would).
  returned: always
  type: bool
  sample: true
action:
  description: What was done, or in check mode what would be.
  returned: always
  type: str
  sample: started
"""

import json
import os
import signal
import time

from ansible.module_utils.basic import AnsibleModule


def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except (IOError, OSError):
        return ""


def start_time(pid):
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), or None when there is no such process."""
    try:
        with open("/proc/%d/stat" % pid) as handle:
            stat = handle.read()
    except (IOError, OSError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has exited
        return None
    return int(fields[19])


def read_record(path):
    try:
        with open(path) as handle:
            record = json.load(handle)
        return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None
    except (IOError, OSError, ValueError):
        return None


def running_pid(path):
    """The recorded pid when that very process still runs, else None."""
    record = read_record(path)
    if record is None:
        return None
    if record.get("boot_id") != boot_id() or start_time(record["pid"]) != record.get("start_time"):
        return None
    return record["pid"]


def write_record(path, pid, command):
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as handle:
        json.dump({"pid": pid, "start_time": start_time(pid), "boot_id": boot_id(), "command": command}, handle)
    os.replace(tmp, path)


def tail(path, limit=4000):
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - limit))
            return handle.read().decode("utf-8", "replace")
    except (IOError, OSError):
        return ""


def signal_process(pid, signum):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it exited meanwhile


def stop(pid, timeout):
    """SIGTERM, then SIGKILL after ``timeout``; returns once that very process is gone."""
    first = start_time(pid)
    signal_process(pid, signal.SIGTERM)
    for signum, wait in ((None, timeout), (signal.SIGKILL, 10)):
        if signum is not None and start_time(pid) == first:
            signal_process(pid, signum)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if start_time(pid) != first:
                return
            time.sleep(0.1)


def spawn(argv, cwd, env, logfile):
    """Fork and exec ``argv`` in a new session, output appended to ``logfile``; returns
    its pid once the exec succeeded, or raises OSError with the reason it did not.
    A child of this module process, which exits right after: init adopts it."""
    report_r, report_w = os.pipe()  # close-on-exec: EOF means the exec succeeded
    pid = os.fork()
    if pid == 0:  # the child: never return into the module
        try:
            os.close(report_r)
            os.setsid()
            stdin = os.open(os.devnull, os.O_RDONLY)
            out = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            os.dup2(stdin, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.closerange(3, report_w)
            os.closerange(report_w + 1, 65536)
            if cwd:
                os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            os.write(report_w, str(exc).encode("utf-8", "replace"))
        finally:
            os._exit(127)
    os.close(report_w)
    chunks = []
    while True:
        chunk = os.read(report_r, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(report_r)
    if chunks:
        os.waitpid(pid, 0)
        raise OSError(b"".join(chunks).decode("utf-8", "replace"))
    return pid


def exit_status(pid):
    """The exit status of our child ``pid`` once it has exited, else None."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        return None
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)


def start(module, params, logfile):
    pidfile = params["pidfile"]
    for directory in sorted(set([os.path.dirname(pidfile), os.path.dirname(logfile)])):
        if directory and not os.path.isdir(directory):
            os.makedirs(directory)
    env = dict(os.environ)
    env.update(dict((k, str(v)) for k, v in params["environment"].items()))
    try:
        pid = spawn(params["command"], params["chdir"], env, logfile)
    except OSError as exc:
        module.fail_json(msg="%s: cannot start %s: %s" % (params["name"], params["command"][0], exc))
    write_record(pidfile, pid, params["command"])
    deadline = time.monotonic() + params["startup_check"]
    while time.monotonic() < deadline:
        code = exit_status(pid)
        if code is not None:
            module.fail_json(
                msg="%s exited with status %s right after it started; the end of %s:\n%s"
                % (params["name"], code, logfile, tail(logfile)),
                pid=None, running=False, action="failed",
            )
        time.sleep(0.1)
    return pid


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            command=dict(type="list", elements="str"),
            pidfile=dict(type="path", required=True),
            logfile=dict(type="path"),
            chdir=dict(type="path"),
            environment=dict(type="dict", default={}),
            state=dict(type="str", default="started", choices=["started", "stopped", "restarted", "reloaded"]),
            stop_timeout=dict(type="float", default=30),
            startup_check=dict(type="float", default=2),
        ),
        required_if=[
            ("state", "started", ("command",)),
            ("state", "restarted", ("command",)),
            ("state", "reloaded", ("command",)),
        ],
        supports_check_mode=True,
    )
    params = module.params
    state = params["state"]
    logfile = params["logfile"] or os.path.splitext(params["pidfile"])[0] + ".log"
    pid = running_pid(params["pidfile"])

    if state == "started" and pid is not None:
        module.exit_json(changed=False, pid=pid, running=True, action="none")
    if state == "stopped" and pid is None:
        module.exit_json(changed=False, pid=None, running=False, action="none")

    if state == "stopped":
        action = "stopped"
    elif state == "reloaded" and pid is not None:
        action = "reloaded"
    elif state == "restarted" and pid is not None:
        action = "restarted"
    else:
        action = "started"
    if module.check_mode:
        module.exit_json(changed=True, pid=pid, running=action != "stopped", action=action)

    if action == "reloaded":
        os.kill(pid, signal.SIGHUP)
        module.exit_json(changed=True, pid=pid, running=True, action=action)
    if pid is not None:  # stopped or restarted
        stop(pid, params["stop_timeout"])
    if action == "stopped":
        try:
            os.unlink(params["pidfile"])
        except OSError:
            pass
        module.exit_json(changed=True, pid=None, running=False, action=action)
    module.exit_json(changed=True, pid=start(module, params, logfile), running=True, action=action)


if __name__ == "__main__":
    main()
