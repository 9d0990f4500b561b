"""Loaded by Python at start-up in a command run by ``gpushare run`` (this folder is
first on its PYTHONPATH): attach the process as a session, then run the sitecustomize
this one shadows, if there is one. A Python that cannot import gpushare is refused here,
before the program runs ungated."""

import importlib.machinery
import importlib.util
import os
import sys
import types

# "1": the command gpushare run started; this process's own pid: the session's program
# exec'd itself or another program (os.execv keeps the pid: it stays the session); any
# other pid: a process the session started, not attached.
if os.environ.get("GPUSHARE_AUTOATTACH") in ("1", str(os.getpid())):
    try:
        from gpushare.client.runner import child_start
    except ImportError as _e:
        sys.stderr.write(
            f"gpushare run: error: this Python ({sys.executable}, {sys.version.split()[0]})"
            f" cannot import gpushare ({_e}): install gpushare in it, or run the command"
            f" with the Python gpushare is installed in"
            f" ({os.environ.get('GPUSHARE_PYTHON', 'the one gpushare run uses')})\n"
        )
        sys.stderr.flush()
        os._exit(3)  # SystemExit would be reported and ignored in sitecustomize
    child_start()
elif os.environ.get("GPUSHARE_AUTOATTACH", "").isdigit() and not os.environ.get(
    "GPUSHARE_UNGATED_SAID"
):
    # A Python process the session's process started (multiprocessing's spawn or
    # forkserver, an engine's workers): not a session. Nothing is said unless it uses
    # CUDA, then one line at its CUDA start (torch.cuda._lazy_init, which every first
    # use goes through), where its GPU work ran ungated without a word. No gpushare
    # import here: a child that never uses CUDA pays a look at each import's name.

    class _SayCudaUngated:
        def find_spec(
            self, name: str, path: object = None, target: object = None
        ) -> importlib.machinery.ModuleSpec | None:
            if name != "torch.cuda":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            loader = getattr(spec, "loader", None)
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            run = loader.exec_module

            def exec_module(module: types.ModuleType) -> None:
                run(module)
                names = vars(module)
                init = names["_lazy_init"]

                def _lazy_init() -> object:
                    names["_lazy_init"] = init  # said once: the original from now on
                    os.write(
                        2,
                        f"gpushare run: process {os.getpid()}, started by the session's process"
                        f" {os.environ['GPUSHARE_AUTOATTACH']}, uses CUDA ungated (not a session:"
                        f" its GPU work is not gated, its memory not counted): start GPU"
                        f" processes with a launcher (gpushare run -- torchrun ...), or call"
                        f" gpushare.attach() in them (docs/run.md)\n".encode(),
                    )
                    return init()

                names["_lazy_init"] = _lazy_init

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _SayCudaUngated())

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _path = os.path.join(_entry or os.getcwd(), "sitecustomize.py")
    if os.path.abspath(_entry or os.getcwd()) != _here and os.path.isfile(_path):
        _spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _path)
        if _spec and _spec.loader:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
