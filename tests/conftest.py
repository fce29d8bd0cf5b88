import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# `python -m pytest` from the repository root puts the root on sys.path, where `kernels/` (installed as
# zcompile.kernels) shadows the `kernels` package transformers imports when it builds a model
# (ImportError: cannot import name 'CUDAProperties' from 'kernels'). The suite imports the project
# through the installed package only; the ranks it spawns inherit this path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

# Triton picks the interpreter when a kernel is decorated, i.e. when its module is first
# imported; set it before any test module imports zcompile so that, without a GPU, the Triton
# kernels run on CPU tensors through the interpreter.
try:
    import torch

    _has_gpu = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_gpu = False
if not _has_gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs one worker per core (the README's -n 2 on two cores): a worker's intra-op thread
# pool as wide as the machine only contends with the other worker and its ranks (each rank runs one
# thread: support/launch.py). One core's share each made the single-process tests ~10% faster here.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 1 and "torch" in sys.modules:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
