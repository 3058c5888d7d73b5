"""Launch a distributed job, with the options of MXNet's tools/launch.py:

    python -m gradpack.launch -n 2 -s 2 python train.py --epochs 3

starts a scheduler, the servers (``python -m gradpack.node``) and the workers
(your command), each with MXNet's DMLC_* variables. It ends every process it
started when the job ends, when one of them fails and when it gets SIGINT,
SIGTERM or SIGHUP, and returns non-zero on failure. On Linux its processes get
SIGKILL when it dies, even by SIGKILL. ``--launcher ssh -H hostfile`` starts
servers and workers round-robin on the hosts listed (one per line) over ssh;
the scheduler runs here.

Every process gets the job's secret (GRADPACK_SECRET), so that its messages
are authenticated: the caller's GRADPACK_SECRET or GRADPACK_SECRET_FILE when
set, otherwise a random one made for this job. It travels in the environment
of local processes and on the standard input of ssh, never on a command line."""
import argparse
import ctypes
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
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


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with(parent):
    """A preexec_fn that has the kernel send the child SIGKILL when `parent`
    dies: a launcher that is killed by SIGKILL cannot stop its processes itself,
    and it cannot escalate either, so the signal must be one nothing ignores."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not between fork and exec

    def preexec():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        # A parent that died before prctl sends nothing: the child was already reparented.
        if os.getppid() != parent:
            os._exit(1)
    return preexec


class Job(object):
    def __init__(self, verbose):
        self.procs = []  # (name, Popen)
        self.verbose = verbose
        self.stop_signal = None
        self.preexec = die_with(os.getpid()) if sys.platform.startswith("linux") else None

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
        # A session of its own: kill_all reaches the whole process tree with killpg.
        p = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=self.preexec,
                             stdin=subprocess.PIPE if stdin_line is not None else None)
        if stdin_line is not None:
            try:
                p.stdin.write((stdin_line + "\n").encode())
                p.stdin.close()
            except OSError:
                pass  # it already died; wait() reports it
        self.procs.append((name, p))

    def kill_all(self, grace=3.0):
        for _, p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.time() + grace
        for _, p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait()

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
    return args


def job_secret(environ):
    """The job's secret: the caller's GRADPACK_SECRET or the contents of its
    GRADPACK_SECRET_FILE (without a trailing newline), else a new random one."""
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
    dmlc.update(e.split("=", 1) for e in args.env)
    secret = job_secret(os.environ)
    node = [sys.executable, "-m", "gradpack.node"]

    job = Job(args.verbose)
    job.stop_on_signals()

    def start(name, role, argv, host_index):
        env = dict(dmlc, DMLC_ROLE=role)
        if args.launcher == "local" or role == "scheduler":
            local = dict(os.environ, **env)
            local.pop("GRADPACK_SECRET_FILE", None)
            job.start(name, argv, dict(local, GRADPACK_SECRET=secret))
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


if __name__ == "__main__":
    sys.exit(main())
