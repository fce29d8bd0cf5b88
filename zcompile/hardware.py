"""``zcompile.hardware.load_profile``: the public path of ``zcompile.predict.hardware``."""

from zcompile.predict.hardware import HardwareProfile, HardwareProfileError, available_profiles, load_profile

__all__ = ["load_profile", "available_profiles", "HardwareProfile", "HardwareProfileError"]
