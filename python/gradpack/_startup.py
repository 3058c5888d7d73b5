"""The opt-in start-up hook: MXNet scripts unchanged under MXNet's launcher.

pip installs ``gradpack-startup.pth`` in site-packages. Python reads it at
every start, and its one line imports this module only in a process with
``GRADPACK_SERVE_ROLES`` set to anything but a false spelling (below) and
``DMLC_ROLE`` scheduler or server (surrounding whitespace ignored); every
other process pays two environment lookups and imports nothing. Here, before the script has run a
line (so before it can ``import mxnet`` and hand the role to MXNet's
ps-lite), the process serves its role with gradpack until the job ends, and
exits as ``python -m gradpack.node`` does: 0 when the job ended, 1 when it
failed. Workers run the script; they need only ``gradpack.mxnet.install()``.

``GRADPACK_SERVE_ROLES`` takes the usual boolean spellings (1/0, true/false,
yes/no, on/off; any case, whitespace trimmed; empty counts as unset). Any
other value is named in a warning and the hook does nothing: this module
runs at the start of every Python program of the process's environment, and
must never stop one.

``python -m gradpack.launch`` sets ``GRADPACK_SERVE_ROLES=1`` for every
process; with MXNet's ``tools/launch.py``, set it in the launcher's
environment."""
import os
import sys

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def serve_roles(value):
    """True, False, or None (not a boolean) for a GRADPACK_SERVE_ROLES value."""
    value = (value or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


def _run():
    value = os.environ.get("GRADPACK_SERVE_ROLES")
    serve = serve_roles(value)
    if serve is None:
        sys.stderr.write("gradpack: warning: GRADPACK_SERVE_ROLES=%r is not one of 1/0, true/false, yes/no, on/off: "
                         "the start-up hook does not serve this %s role (set GRADPACK_SERVE_ROLES=1 to serve it "
                         "with gradpack)\n" % (value, os.environ.get("DMLC_ROLE", "").strip()))
        sys.stderr.flush()
        return
    if not serve:
        return
    try:
        from .kv import serve_and_exit
    except BaseException as e:  # an exception here would only be printed by site.py, and ps-lite would serve
        sys.stderr.write("gradpack %s: the start-up hook could not load gradpack: %s: %s\n"
                         % (os.environ.get("DMLC_ROLE", "").strip(), type(e).__name__, e))
        sys.stderr.flush()
        os._exit(1)
    serve_and_exit()  # never returns


_run()
