"""The torch functions re-routed once a parameter is sharded (``GradScaler``, ``zero_grad``,
``backward(inputs=)`` / ``autograd.grad``, gradient clipping, torch optimizers over zcompile
parameters), each patched once per process."""
