"""Launch a distributed job, with the options of MXNet's tools/launch.py:

    python -m gradpack.launch -n 2 -s 2 python train.py --epochs 3

starts a scheduler, the servers (``python -m gradpack.node``) and the workers
(your command), each with MXNet's DMLC_* variables and GRADPACK_SERVE_ROLES=1
(unless set otherwise: the start-up hook, gradpack/_startup.py), and returns
non-zero on failure. ``--launcher ssh -H hostfile`` starts servers and workers
round-robin on the hosts listed (one per line) over ssh; the scheduler runs
here.

Ending. Every process it starts leads a session, so a process group, of its
own, and the launcher ends the group, not only that process (SIGTERM, then
SIGKILL to what is left after 3 s): when the job ends (what a node left
running in the background included), when a node fails, and when it gets
SIGINT, SIGTERM or SIGHUP. For its own death, even by SIGKILL, it forks at
start a watchdog, in a session of its own, that reads a pipe whose write end
only the launcher holds. The end is close-on-exec: a starting node holds it
only until exec, and writes its group's id there first, so that a launcher
killed while starting it leaves no group unknown. On the launcher's "exit"
the watchdog exits; at end-of-file (the launcher died) it removes the secret
file the launcher made, ends every group not known to have ended, and exits.
A process that leaves its group (setsid, setpgid) is out of reach; over ssh
only the local ``ssh`` clients end.

The secret, so that messages are authenticated. Local processes get a file,
GRADPACK_SECRET_FILE, and not GRADPACK_SECRET, which /proc/PID/environ would
show: the caller's GRADPACK_SECRET_FILE (made absolute), else a file the
launcher makes, holding a new random secret, readable only by the user (mode
0600, in a new directory of mode 0700 under the temporary directory) and
removed when the job ends. The one exception: a caller's own GRADPACK_SECRET
(that caller already chose the environment) is passed on as it is. Both set
is refused, as the nodes refuse it, and so is either in ``--env`` (a command
line shows in ps). Over ssh the secret travels on standard input; the remote
shell exports it as GRADPACK_SECRET."""
import argparse
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port():
    """A port that is free now and that the OS will not hand out to another
    socket (this job's nodes' included) before the scheduler binds it: below
    the ephemeral range, from which sockets that bind no port of their own
    draw theirs. A port from bind(0) is itself ephemeral, and was once found
    taken ("Address already in use") between this check and the
    scheduler's bind."""
    import random
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    if low > 2048:
        for _ in range(100):
            port = rng.randrange(1024, low)
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def local_ip_towards(host):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


KILL_GRACE = 3.0  # seconds between SIGTERM and SIGKILL


def group_exists(pgid):
    """Whether process group `pgid` still has a process (an unreaped zombie
    counts: until it is reaped its id cannot go to another process)."""
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:  # ESRCH; EPERM: another user's, so the id was reused
        return False


def signal_groups(pgids, signum):
    for pgid in pgids:
        try:
            os.killpg(pgid, signum)
        except OSError:
            pass  # it ended already


def end_groups(pgids, grace, reap=lambda: None):
    """SIGTERM to every process group in `pgids`, then SIGKILL to those that
    still exist after `grace` seconds. `reap` is called while waiting: a
    leader's unreaped zombie keeps its group in existence. So does an orphan's
    zombie that init reaps late; the wait then lasts the whole grace, and
    SIGKILL to a zombie does no harm."""
    signal_groups(pgids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    left = list(pgids)
    while True:
        reap()
        left = [pgid for pgid in left if group_exists(pgid)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    signal_groups(left, signal.SIGKILL)


def watch(read_fd, grace):
    """The watchdog's body (see the module doc). Records on the pipe end with
    NUL: b"+PGID" a group to end, b"-PGID" a group that ended (its id may be
    reused), b"rPATH" a directory to remove, b"exit" the launcher's normal end."""
    os.setsid()  # a Ctrl-C or hangup that reaches the launcher's group does not reach it
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # no reader of the launcher's output waits for it; stderr stays
    groups, directories, pending = set(), [], b""
    while True:
        chunk = os.read(read_fd, 4096)
        if not chunk:
            break  # every write end is closed: the launcher died
        *records, pending = (pending + chunk).split(b"\0")
        for record in records:
            if record == b"exit":
                return
            kind, arg = record[:1], record[1:]
            if kind == b"+":
                groups.add(int(arg))
            elif kind == b"-":
                groups.discard(int(arg))
            elif kind == b"r":
                directories.append(os.fsdecode(arg))
    print("[gradpack.launch] the launcher died; its watchdog stops the job", file=sys.stderr, flush=True)
    for path in directories:
        shutil.rmtree(path, ignore_errors=True)
    end_groups(sorted(groups), grace)


class Watchdog(object):
    """A process, forked before any node starts, that ends the job when the
    launcher dies without ending it itself, even by SIGKILL."""

    def __init__(self, grace):
        read_fd, self.write_fd = os.pipe()  # both close-on-exec: no node keeps either
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self.write_fd)
                watch(read_fd, grace)
            finally:
                os._exit(0)  # never back into the launcher's code, whatever happened
        os.close(read_fd)

    def send(self, record):
        try:
            # Never two writers at once: Popen returns once its child has written and exec'd.
            os.write(self.write_fd, record + b"\0")
        except OSError:
            pass  # it was killed: the launcher still ends its job itself

    def register(self):
        """A preexec_fn that registers the new process's group from inside the
        child, before exec: a launcher killed while starting a node leaves no
        group unregistered, since the pipe reaches end-of-file only once the
        child has written and exec closed its copy. subprocess has already set
        SIGPIPE back to its default there, and a write to a dead watchdog must
        not kill the child."""
        write_fd = self.write_fd

        def preexec():
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)
            try:
                os.write(write_fd, b"+%d\0" % os.getpid())  # it leads a new session: pgid == pid
            except OSError:
                pass
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        return preexec

    def forget(self, pgid):
        self.send(b"-%d" % pgid)

    def remove_on_death(self, path):
        self.send(b"r" + os.fsencode(path))

    def close(self):
        """The launcher ended its job itself: the watchdog exits and does nothing."""
        self.send(b"exit")
        os.close(self.write_fd)
        os.waitpid(self.pid, 0)


class Job(object):
    def __init__(self, verbose, watchdog):
        self.procs = []  # (name, Popen); each leads a process group of its own
        self.groups = set()  # the ids of those groups not known to have ended
        self.verbose = verbose
        self.watchdog = watchdog
        self.stop_signal = None

    def stop_on_signals(self):
        """SIGINT, SIGTERM and SIGHUP make wait() stop every process. The handler
        only records the signal, so that it never leaves a start or kill_all
        halfway done. A signal ignored on entry (nohup, `&`) stays ignored."""
        def record(signum, frame):
            self.stop_signal = signum
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) != signal.SIG_IGN:
                signal.signal(s, record)

    def start(self, name, argv, env, stdin_line=None):
        """Starts `argv`; `stdin_line` (a secret for ssh) is written to its
        standard input, which is then closed."""
        if self.stop_signal is not None:
            return
        if self.verbose:
            print("[gradpack.launch] starting %s: %s" % (name, " ".join(argv)), file=sys.stderr)
        # A session of its own: kill_all reaches what it starts in the background with killpg.
        p = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=self.watchdog.register(),
                             stdin=subprocess.PIPE if stdin_line is not None else None)
        self.groups.add(p.pid)
        if stdin_line is not None:
            try:
                p.stdin.write((stdin_line + "\n").encode())
                p.stdin.close()
            except OSError:
                pass  # it already died; wait() reports it
        self.procs.append((name, p))

    def forget_ended(self):
        """Drops the groups with no process left: their ids may go to other processes."""
        for _, p in self.procs:
            if p.pid in self.groups and p.poll() is not None and not group_exists(p.pid):
                self.groups.discard(p.pid)
                self.watchdog.forget(p.pid)

    def kill_all(self, grace=KILL_GRACE):
        """Ends every group, with what a node left running after it ended."""
        end_groups(sorted(self.groups), grace, reap=lambda: [p.poll() for _, p in self.procs])
        for _, p in self.procs:
            p.wait()
        for pgid in self.groups:
            self.watchdog.forget(pgid)  # all got SIGKILL or ended: what is left is a zombie
        self.groups.clear()

    def stopped(self):
        """128 + the signal number after stopping the job when a signal came; else None."""
        if self.stop_signal is None:
            return None
        print("[gradpack.launch] got %s; stopping the job" % signal.Signals(self.stop_signal).name,
              file=sys.stderr)
        self.kill_all()
        return 128 + self.stop_signal

    def wait(self, timeout, end_grace):
        """0 when every worker succeeded and the servers ended; else non-zero."""
        start = time.time()
        workers = [(n, p) for n, p in self.procs if n.startswith("worker")]
        while True:
            self.forget_ended()
            code = self.stopped()
            if code:
                return code
            for name, p in self.procs:
                code = p.poll()
                if code not in (None, 0):
                    print("[gradpack.launch] %s exited with status %d; stopping the job" % (name, code),
                          file=sys.stderr)
                    self.kill_all()
                    return code if code > 0 else 1
            if all(p.poll() == 0 for _, p in workers):
                break
            if timeout and time.time() - start > timeout:
                print("[gradpack.launch] the job ran past --timeout %g s; stopping it" % timeout,
                      file=sys.stderr)
                self.kill_all()
                return 124
            time.sleep(0.05)
        deadline = time.time() + end_grace
        while time.time() < deadline and self.stop_signal is None and any(p.poll() is None for _, p in self.procs):
            time.sleep(0.05)
        code = self.stopped()
        if code:
            return code
        left = [n for n, p in self.procs if p.poll() is None]
        if left:
            print("[gradpack.launch] %s still running after the workers ended; stopping them"
                  % ", ".join(left), file=sys.stderr)
            self.kill_all()
            return 1
        bad = [(n, p.returncode) for n, p in self.procs if p.returncode != 0]
        for n, code in bad:
            print("[gradpack.launch] %s exited with status %d" % (n, code), file=sys.stderr)
        return 1 if bad else 0


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m gradpack.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers")
    p.add_argument("-s", "--num-servers", type=int, help="number of servers (default: the number of workers)")
    p.add_argument("-H", "--hostfile", help="hosts for --launcher ssh, one per line")
    p.add_argument("--launcher", choices=["local", "ssh"], default="local")
    p.add_argument("--port", type=int, default=0, help="the scheduler's port (default: a free one)")
    p.add_argument("--interface", help="network interface, passed on as DMLC_INTERFACE")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an extra environment variable for every process (repeatable)")
    p.add_argument("--timeout", type=float, default=0, help="stop the job after this many seconds (0: never)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command")
    args = p.parse_args(argv)
    if not args.command:
        p.error("give the worker command")
    if args.num_workers < 1:
        p.error("-n must be at least 1")
    args.num_servers = args.num_workers if args.num_servers is None else args.num_servers
    if args.num_servers < 1:
        p.error("-s must be at least 1")
    if args.launcher == "ssh" and not args.hostfile:
        p.error("--launcher ssh needs -H HOSTFILE")
    for e in args.env:
        if "=" not in e:
            p.error("--env takes NAME=VALUE, got %r" % e)
        if e.split("=", 1)[0] in ("GRADPACK_SECRET", "GRADPACK_SECRET_FILE"):
            p.error("--env %s: a command line shows in ps; set it in the launcher's environment" % e.split("=", 1)[0])
    return args


def job_secret(environ):
    """The job's secret: the caller's GRADPACK_SECRET or the contents of its
    GRADPACK_SECRET_FILE (without a trailing newline), else a new random one."""
    if environ.get("GRADPACK_SECRET") and environ.get("GRADPACK_SECRET_FILE"):
        sys.exit("gradpack.launch: GRADPACK_SECRET and GRADPACK_SECRET_FILE are both set; set one")
    if environ.get("GRADPACK_SECRET"):
        secret = environ["GRADPACK_SECRET"]
    elif environ.get("GRADPACK_SECRET_FILE"):
        with open(environ["GRADPACK_SECRET_FILE"]) as f:
            secret = f.read()
        secret = secret[:-1] if secret.endswith("\n") else secret
        secret = secret[:-1] if secret.endswith("\r") else secret
    else:
        secret = secrets.token_hex(32)
    if not secret or "\n" in secret or "\0" in secret:
        sys.exit("gradpack.launch: the job secret must be one non-empty line without NUL")
    return secret


def local_secret(environ, secret, watchdog):
    """The variable that hands `secret` (from job_secret(environ)) to local
    processes, and the directory made to hold it (None when the caller gave
    the secret). The watchdog learns of a directory before it is made: a
    launcher killed at any moment leaves none behind."""
    if environ.get("GRADPACK_SECRET"):
        return {"GRADPACK_SECRET": environ["GRADPACK_SECRET"]}, None
    if environ.get("GRADPACK_SECRET_FILE"):
        return {"GRADPACK_SECRET_FILE": os.path.abspath(environ["GRADPACK_SECRET_FILE"])}, None
    directory = os.path.join(tempfile.gettempdir(), "gradpack-secret-" + secrets.token_hex(8))
    watchdog.remove_on_death(directory)
    os.mkdir(directory, 0o700)  # fails if the name exists: nobody else's directory is used
    path = os.path.join(directory, "secret")
    try:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secret + "\n")
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return {"GRADPACK_SECRET_FILE": path}, directory


def remote_command(argv, env, cwd):
    """The shell command ssh runs on a node: it reads the secret from its
    standard input (so it never appears in a command line or `ps`), then runs
    `argv` with `env`."""
    exports = " ".join("%s=%s" % (k, shlex.quote(v)) for k, v in env.items())
    return ("IFS= read -r GRADPACK_SECRET && export GRADPACK_SECRET && unset GRADPACK_SECRET_FILE && cd %s && env %s %s"
            % (shlex.quote(cwd), exports, " ".join(shlex.quote(a) for a in argv)))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    port = args.port or free_port()
    hosts = []
    if args.launcher == "ssh":
        with open(args.hostfile) as f:
            hosts = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        if not hosts:
            sys.exit("gradpack.launch: %s lists no hosts" % args.hostfile)
    root = local_ip_towards(hosts[0]) if hosts else "127.0.0.1"
    dmlc = {"DMLC_PS_ROOT_URI": root, "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_WORKER": str(args.num_workers), "DMLC_NUM_SERVER": str(args.num_servers)}
    if args.interface:
        dmlc["DMLC_INTERFACE"] = args.interface
    # The start-up hook (gradpack/_startup.py): a command that runs one script
    # for every role still serves the scheduler and servers with gradpack.
    dmlc["GRADPACK_SERVE_ROLES"] = os.environ.get("GRADPACK_SERVE_ROLES", "1")
    dmlc.update(e.split("=", 1) for e in args.env)
    secret = job_secret(os.environ)
    node = [sys.executable, "-m", "gradpack.node"]

    watchdog = Watchdog(KILL_GRACE)  # before any node starts, so that every one registers
    job = Job(args.verbose, watchdog)
    job.stop_on_signals()
    secret_dir = None
    try:
        secret_var, secret_dir = local_secret(os.environ, secret, watchdog)
        local_env = {k: v for k, v in os.environ.items() if k not in ("GRADPACK_SECRET", "GRADPACK_SECRET_FILE")}

        def start(name, role, argv, host_index):
            env = dict(dmlc, DMLC_ROLE=role)
            if args.launcher == "local" or role == "scheduler":
                job.start(name, argv, {**local_env, **env, **secret_var})
                return
            host = hosts[host_index % len(hosts)]
            job.start(name, ["ssh", "-o", "StrictHostKeyChecking=no", host, remote_command(argv, env, os.getcwd())],
                      dict(os.environ), stdin_line=secret)

        start("scheduler", "scheduler", node, 0)
        for i in range(args.num_servers):
            start("server %d" % i, "server", node, i)
        for i in range(args.num_workers):
            start("worker %d" % i, "worker", args.command, args.num_servers + i)
        return job.wait(args.timeout, end_grace=15.0)
    finally:
        job.kill_all()  # after a normal end too: what the nodes left in the background
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)
        watchdog.close()


if __name__ == "__main__":
    sys.exit(main())
