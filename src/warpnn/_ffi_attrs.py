"""Names of the FFI attributes a warpnn call carries: shared by the bridge and both launchers."""

SCALAR_ATTR_PREFIX = "arg_"
"""Prefix of the attribute holding a static scalar argument: ``arg_<name>``."""

LAUNCH_DIMS_ATTR = "launch_dims"
"""The attribute holding the launch dims (an int64 array)."""
