"""Sources (and, once built, the shared library) of warpnn's native XLA FFI launcher; see ``warpnn._native_launch``."""
