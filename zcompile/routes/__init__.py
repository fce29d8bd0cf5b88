"""The torch functions re-routed once a parameter is sharded: gradient clipping, ``GradScaler``,
``module.zero_grad()``, ``backward(inputs=)`` / ``autograd.grad``, and a torch optimizer stepping
zcompile parameters (refused). ``install()`` patches them once per process; the backend, the sharded
optimizer and weight averaging call it before they make a shard, so no zcompile parameter exists
before the routes are in place."""

from zcompile.routes.autograd import install_autograd_route
from zcompile.routes.clip_grad import install_torch_clip_patch
from zcompile.routes.grad_scaler import install_grad_scaler_route
from zcompile.routes.optimizer_guard import install_foreign_optimizer_guard
from zcompile.routes.zero_grad import install_zero_grad_route


def install() -> None:
    """Every route (idempotent)."""
    install_torch_clip_patch()  # torch.nn.utils.clip_grad_norm_ / clip_grad_value_ clip the averaged shards
    install_grad_scaler_route()  # a GradScaler unscales and checks the shards, every rank together
    install_zero_grad_route()  # module.zero_grad() clears the gradient shards
    install_foreign_optimizer_guard()  # a torch optimizer does not step what it cannot update
    install_autograd_route()  # backward(inputs=...) / autograd.grad find where gradients accumulate
