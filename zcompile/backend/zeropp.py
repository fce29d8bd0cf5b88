"""ZeRO++ settings for one compile: the options after fallbacks, and the groups they run on.

``resolve_zeropp`` turns the options into what will actually run, logging each fallback (the
usual misconfigurations: odd node counts, sizes that do not divide, a world of one) instead of
crashing or corrupting; it reads no other rank, so it is the same on every rank given the same
options, and its ``signature`` joins the compile-time rank check. ``attach_groups`` then makes the
process groups (collective, so only after that check has passed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from zcompile.common.process_group import DataParallelGroup
from zcompile.common.topology import node_groups, node_size_from_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZeroPPSettings:
    quantize_weights: bool = False
    quantize_grads: bool = False
    block: int = 2048
    hpz_size: int = 0  # 0: hpZ off
    node_size: int = 1
    hpz_rank: int = 0  # this rank's index in its hpZ group
    hpz_group_name: str | None = None  # filled by attach_groups
    intra_group_name: str | None = None  # qgZ's groups, filled by attach_groups
    inter_group_name: str | None = None

    @property
    def active(self) -> bool:
        return self.quantize_weights or self.quantize_grads or self.hpz_size > 0

    def signature(self) -> list:
        """What every rank must agree on (no group names: those differ per node)."""
        return ["zero++", self.quantize_weights, self.quantize_grads, self.block, self.hpz_size, self.node_size]


def resolve_zeropp(config, group: DataParallelGroup) -> ZeroPPSettings:
    """The ZeRO++ techniques that will run for ``config`` on ``group``, with fallbacks logged."""
    wanted = config.quantize_weights or config.quantize_grads or config.hpz_size is not None
    if not wanted:
        return ZeroPPSettings()
    world = group.world_size
    if world == 1:
        log.warning(
            "zcompile: ZeRO++: world size 1, nothing is communicated; quantize_weights, quantize_grads and "
            "hpz_size are ignored"
        )
        return ZeroPPSettings()
    node_size = node_size_from_env(config.node_size, world)
    if world % node_size:
        log.warning(
            "zcompile: ZeRO++: %d ranks do not split into nodes of %d; treating all ranks as one node (qgZ reduces "
            "inside it, hpz_size='node' turns hpZ off)",
            world,
            node_size,
        )
        node_size = world
    hpz_size = 0
    if config.hpz_size is not None:
        hpz_size = node_size if config.hpz_size == "node" else config.hpz_size
        if world % hpz_size:
            log.warning(
                "zcompile: ZeRO++: hpz_size=%d does not divide the world size %d; hpZ is off (plain stage-3 re-gather)",
                hpz_size,
                world,
            )
            hpz_size = 0
        elif hpz_size == world:
            log.warning(
                "zcompile: ZeRO++: hpz_size equals the world size %d, so the secondary partition is the primary "
                "one; hpZ is off (plain stage-3 re-gather, no extra memory)",
                world,
            )
            hpz_size = 0
    return ZeroPPSettings(
        config.quantize_weights,
        config.quantize_grads,
        config.quantize_block,
        hpz_size,
        node_size,
        group.rank % hpz_size if hpz_size else 0,
    )


def attach_groups(settings: ZeroPPSettings, group: DataParallelGroup) -> ZeroPPSettings:
    """``settings`` with the names of the process groups its passes use (makes them the first time)."""
    if not settings.active:
        return settings
    changes = {}
    if settings.hpz_size > 1:
        changes["hpz_group_name"] = node_groups(group, settings.hpz_size).intra.name
    if settings.quantize_grads:
        groups = node_groups(group, settings.node_size)
        changes.update(intra_group_name=groups.intra.name, inter_group_name=groups.inter.name)
    return replace(settings, **changes)
