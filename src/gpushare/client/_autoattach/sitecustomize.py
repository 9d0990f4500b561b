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
# other pid: a process the session started, a member of it once it does GPU work.
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
elif (
    os.environ.get("GPUSHARE_AUTOATTACH", "").isdigit()
    and os.environ.get("GPUSHARE_FAMILY")
    and not os.environ.get("GPUSHARE_UNGATED_SAID")
):
    # A Python process the session's program started (multiprocessing's spawn or
    # forkserver, an engine's workers, a subprocess): it joins the session at its first
    # GPU work (gpushare.client.runner.watch_for_gpu_work), once PyTorch is imported. No
    # gpushare import before: a child that never imports PyTorch pays a look at each
    # import's name. (The ranks of torch.multiprocessing.spawn were said for by it.)

    class _JoinAtGpuWork:
        # Kept until torch is imported, not just looked for: transformers asks
        # find_spec("torch") without importing it (seen in vLLM's processes).
        looking = False

        def find_spec(
            self, name: str, path: object = None, target: object = None
        ) -> importlib.machinery.ModuleSpec | None:
            if name != "torch" or self.looking:
                return None
            self.looking = True
            try:
                spec = importlib.util.find_spec(name)  # the other finders' (this one: None)
            finally:
                self.looking = False
            loader = getattr(spec, "loader", None)
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            run = loader.exec_module

            def exec_module(module: types.ModuleType) -> None:
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                run(module)
                from gpushare.client.runner import watch_for_gpu_work

                watch_for_gpu_work(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _JoinAtGpuWork())

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _path = os.path.join(_entry or os.getcwd(), "sitecustomize.py")
    if os.path.abspath(_entry or os.getcwd()) != _here and os.path.isfile(_path):
        _spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _path)
        if _spec and _spec.loader:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
