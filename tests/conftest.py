import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
