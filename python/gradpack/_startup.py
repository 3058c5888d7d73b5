"""The opt-in start-up hook: MXNet scripts unchanged under MXNet's launcher.

pip installs ``gradpack-startup.pth`` in site-packages. Python reads it at
every start, and its one line imports this module only in a process with
``GRADPACK_SERVE_ROLES`` set (not "0") and ``DMLC_ROLE`` scheduler or server;
every other process pays one environment lookup and imports nothing. Here,
before the script has run a line (so before it can ``import mxnet`` and hand
the role to MXNet's ps-lite), the process serves its role with gradpack until
the job ends, and exits as ``python -m gradpack.node`` does: 0 when the job
ended, 1 when it failed. Workers run the script; they need only
``gradpack.mxnet.install()``.

``python -m gradpack.launch`` sets ``GRADPACK_SERVE_ROLES=1`` for every
process; with MXNet's ``tools/launch.py``, set it in the launcher's
environment."""
import os
import sys


def _run():
    value = os.environ.get("GRADPACK_SERVE_ROLES")
    if value != "1":
        sys.stderr.write("gradpack: GRADPACK_SERVE_ROLES must be 1 (serve the scheduler and server roles "
                         "with gradpack at start) or 0, got %r\n" % value)
        sys.stderr.flush()
        os._exit(2)
    try:
        from .kv import serve_and_exit
    except BaseException as e:  # an exception here would only be printed by site.py, and ps-lite would serve
        sys.stderr.write("gradpack %s: the start-up hook could not load gradpack: %s: %s\n"
                         % (os.environ.get("DMLC_ROLE"), type(e).__name__, e))
        sys.stderr.flush()
        os._exit(1)
    serve_and_exit()  # never returns


_run()
