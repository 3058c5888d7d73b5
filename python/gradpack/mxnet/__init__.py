"""gradpack inside a real MXNet (1.9.1 from PyPI).

Importing this module registers gradpack's operators
(``mx.nd.contrib.create_2bit`` / ``quantize_2bit`` / ``dequantize_2bit``) and
its KVStore plugins (``mx.kv.create('gradpack_device')``, ``'gradpack_local'``)
and changes nothing else. ``gradpack.mxnet.install()`` then makes the
proposal's API work verbatim: ``mx.kv.create('device')`` returns a gradpack
store with ``set_compress``, and ``mx.mod.Module`` / ``mx.gluon.Trainer``
accept ``compress_params=``. ``uninstall()`` restores MXNet's own.

MXNet's launch contract (``tools/launch.py``: one script for every role,
``DMLC_ROLE`` set): with ``GRADPACK_SERVE_ROLES=1`` in the launcher's
environment, gradpack's start-up hook (``gradpack._startup``) serves the
scheduler and server roles before the script runs, whatever it imports first.
Without it, this module imported before ``mxnet`` in a scheduler or server
process serves that role with gradpack until the job ends and exits the
process, as ``import mxnet`` does with ps-lite; imported after ``mxnet`` it is
too late: MXNet's ps-lite has already taken the role, and gradpack's workers
then fail within seconds with an error that says what to change.
"""
import os as _os
import sys as _sys

if _os.environ.get("DMLC_ROLE", "").strip() in ("scheduler", "server") and "mxnet" not in _sys.modules:
    from ..kv import serve_and_exit as _serve_and_exit
    _serve_and_exit()  # never returns

try:
    import mxnet as mx
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "gradpack.mxnet needs MXNet 1.9.1: pip install 'mxnet==1.9.1' 'numpy<1.24' "
        "(then reinstall gradpack so its operator library is built): %s" % e) from e

from .ops import OperatorError, create_2bit, dequantize_2bit, quantize_2bit
from .kvstore import GradpackStore, KVStoreError, create
from .module import Module
from .trainer import Trainer

__all__ = ["OperatorError", "KVStoreError", "GradpackStore", "create", "Module", "Trainer", "install",
           "uninstall", "installed"]

_saved = None


def install():
    """Route MXNet's API to gradpack: ``mx.kv.create`` (and ``mx.kvstore.create``),
    ``mx.mod.Module`` (and ``mx.module.Module``), ``mx.gluon.Trainer``.
    Idempotent."""
    global _saved
    if _saved is not None:
        return
    import mxnet.kvstore
    import mxnet.module
    _saved = {
        (mx.kv, "create"): mx.kv.create,
        (mx.kvstore, "create"): mx.kvstore.create,
        (mx.mod, "Module"): mx.mod.Module,
        (mx.module, "Module"): mx.module.Module,
        (mx.gluon, "Trainer"): mx.gluon.Trainer,
    }
    mx.kv.create = create
    mx.kvstore.create = create
    mx.mod.Module = Module
    mx.module.Module = Module
    mx.gluon.Trainer = Trainer


def uninstall():
    """Undo ``install()``."""
    global _saved
    if _saved is None:
        return
    for (module, name), value in _saved.items():
        setattr(module, name, value)
    _saved = None


def installed():
    return _saved is not None
